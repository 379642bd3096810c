#include "dry_backend.h"

#include <utility>
#include <vector>

#include <ATen/ops/empty_like.h>

namespace fsdp_plan::detail {
namespace {

int64_t bytes_of(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t total = 0;
  for (const at::Tensor& t : ts) total += bytes_of(t);
  return total;
}

// Complete from the start. `held` is what the engine keeps until the wait.
class DryWork final : public c10d::Work {
 public:
  explicit DryWork(c10d::OpType type, std::vector<at::Tensor> held = {})
      : c10d::Work(/*rank=*/-1, type), held_(std::move(held)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  std::exception_ptr exception() const override { return nullptr; }
  bool wait(std::chrono::milliseconds) override {
    held_.clear();
    return true;
  }
  void synchronize() override {}

 private:
  std::vector<at::Tensor> held_;
};

class DryBackend final : public c10d::Backend {
 public:
  DryBackend(int rank, int size, bool gloo_buffers, CollectiveCallback on_collective)
      : c10d::Backend(rank, size), gloo_buffers_(gloo_buffers), on_collective_(std::move(on_collective)) {}

  const std::string getBackendName() const override { return "dry"; }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    on_collective_("all_gather_into_tensor", bytes_of(output), {input}, {output});
    gathered({output});
    return c10::make_intrusive<DryWork>(c10d::OpType::_ALLGATHER_BASE);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) override {
    on_collective_("all_gather_into_tensor_coalesced", bytes_of(outputs), inputs, outputs);
    gathered(outputs);
    return c10::make_intrusive<DryWork>(c10d::OpType::COALESCED);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions&) override {
    on_collective_("reduce_scatter_tensor", bytes_of(input), {input}, {output});
    return c10::make_intrusive<DryWork>(c10d::OpType::_REDUCE_SCATTER_BASE, received({input}));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions&) override {
    on_collective_("reduce_scatter_tensor_coalesced", bytes_of(inputs), inputs, outputs);
    return c10::make_intrusive<DryWork>(c10d::OpType::COALESCED, received(inputs));
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions&) override {
    on_collective_("all_reduce", bytes_of(tensors), tensors, tensors);
    return c10::make_intrusive<DryWork>(c10d::OpType::ALLREDUCE);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions&) override {
    on_collective_("broadcast", bytes_of(tensors), tensors, tensors);
    return c10::make_intrusive<DryWork>(c10d::OpType::BROADCAST);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    on_collective_("barrier", 0, {}, {});
    return c10::make_intrusive<DryWork>(c10d::OpType::BARRIER);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>&,
                                               std::vector<int64_t>&, const c10d::AllToAllOptions&) override {
    on_collective_("all_to_all", bytes_of(input), {input}, {output});
    return c10::make_intrusive<DryWork>(c10d::OpType::ALLTOALL_BASE);
  }

 private:
  // What the Gloo engine allocates for a reduce-scatter, held until the
  // wait: at two or more ranks this project's all-to-all receive buffer
  // ([Note: Gloo reduce-scatter] in collectives/src/communicator.cc), at one
  // rank c10d's copy of the input (ProcessGroupGloo's _reduce_scatter_base
  // all-reduces a copy); both as large as the input.
  std::vector<at::Tensor> received(const std::vector<at::Tensor>& inputs) const {
    std::vector<at::Tensor> held;
    if (!gloo_buffers_) return held;
    for (const at::Tensor& in : inputs) held.push_back(at::empty_like(in));
    return held;
  }
  // ProcessGroupGloo's all-gather gathers into a flat buffer as large as the
  // output and copies it out; it lives while the engine runs the collective
  // (on its worker thread at two or more ranks), here for an instant.
  void gathered(const std::vector<at::Tensor>& outputs) const {
    if (!gloo_buffers_) return;
    for (const at::Tensor& out : outputs) at::empty_like(out);
  }

  bool gloo_buffers_;
  CollectiveCallback on_collective_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_dry_backend(int rank, int size, bool gloo_buffers,
                                                   CollectiveCallback on_collective) {
  return c10::make_intrusive<DryBackend>(rank, size, gloo_buffers, std::move(on_collective));
}

}  // namespace fsdp_plan::detail
