// NVTX ranges of the FSDP phases, seen as a profiler sees them: the rank
// processes run with NVTX_INJECTION64_PATH naming our recorder library
// (nvtx_recorder.cc), the mechanism Nsight Systems uses, and each rank checks
// the ranges its own process pushed during one sharded training step. Needs
// a CUDA build (NVTX3 comes with the toolkit) but no GPU: Gloo on CPU.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp_testing/distributed_test.h"

namespace {

struct LayerImpl : torch::nn::Module {
  LayerImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(Layer);

// layers.0 (8 -> 6), layers.1 (6 -> 5), head (5 -> 1): the FQNs the ranges name.
struct Net : torch::nn::Module {
  Net() : l0(8, 6), l1(6, 5), head(register_module("head", torch::nn::Linear(5, 1))) {
    auto list = register_module("layers", torch::nn::ModuleList());
    list->push_back(l0);
    list->push_back(l1);
  }
  at::Tensor forward(const at::Tensor& x) { return head(l1(l0(x))).square().mean(); }
  Layer l0, l1;
  torch::nn::Linear head;
};

struct Event {
  std::string thread;
  bool push = false;
  std::string name;
};

std::vector<Event> read_log(const std::string& path) {
  std::vector<Event> events;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const size_t space = line.find(' ');
    Event e;
    e.thread = line.substr(0, space);
    const std::string rest = line.substr(space + 1);
    if (rest == "init") continue;
    e.push = rest.rfind("push ", 0) == 0;
    if (e.push) e.name = rest.substr(5);
    events.push_back(e);
  }
  return events;
}

// Index of the first push of `name` at or after `from`; -1 when none.
long find_push(const std::vector<Event>& events, const std::string& name, size_t from = 0) {
  for (size_t i = from; i < events.size(); ++i) {
    if (events[i].push && events[i].name == name) return static_cast<long>(i);
  }
  return -1;
}

TEST(Nvtx, ShardedStepPushesEveryPhaseWithItsModuleFqn) {
  char dir[] = "/tmp/fsdp2cpp_nvtx.XXXXXX";
  if (!fsdp::testing::is_rank_process()) {
    // The rank processes inherit these; NVTX reads them on its first call.
    ASSERT_NE(::mkdtemp(dir), nullptr);
    ::setenv("NVTX_INJECTION64_PATH", FSDP2CPP_NVTX_RECORDER, 1);
    ::setenv("FSDP2CPP_NVTX_LOG", (std::string(dir) + "/ranges").c_str(), 1);
  }
  fsdp::testing::run_distributed(2, [](fsdp::testing::RankContext& ctx) {
    torch::manual_seed(0);
    auto net = std::make_shared<Net>();
    fsdp::FullyShardOptions options;
    options.mesh = ctx.mesh();
    fsdp::fully_shard(net->l0, options);
    fsdp::fully_shard(net->l1, options);
    fsdp::fully_shard(net, options);
    torch::optim::SGD optim(net->parameters(), torch::optim::SGDOptions(0.1));
    const at::Tensor x = at::randn({4, 8});
    at::Tensor loss = fsdp::call_module(*net, x);
    loss.backward();
    optim.step();
    ASSERT_TRUE(std::isfinite(loss.item<double>()));

    const std::string log = std::string(std::getenv("FSDP2CPP_NVTX_LOG")) + "." + std::to_string(::getpid());
    const std::vector<Event> events = read_log(log);
    ASSERT_FALSE(events.empty()) << "the injection library recorded nothing in " << log
                                 << " (NVTX not loaded, or no ranges pushed)";

    for (const char* name :
         {"FSDP::root_pre_forward", "FSDP::all_gather (root)", "FSDP::pre_forward (layers.0)",
          "FSDP::all_gather (layers.0)", "FSDP::all_gather_copy_in (layers.0)", "FSDP::all_gather_copy_out (layers.0)",
          "FSDP::post_forward (layers.0)", "FSDP::pre_forward (layers.1)", "FSDP::all_gather (layers.1)",
          "FSDP::post_forward (layers.1)", "FSDP::pre_backward (layers.1)", "FSDP::pre_backward (layers.0)",
          "FSDP::post_backward (layers.1)", "FSDP::post_backward (layers.0)", "FSDP::reduce_scatter (layers.1)",
          "FSDP::reduce_scatter (layers.0)", "FSDP::reduce_scatter (root)", "FSDP::root_post_backward"}) {
      EXPECT_GE(find_push(events, name), 0) << "no NVTX range '" << name << "' in " << log;
    }

    // The ranges follow the run: forward goes layers.0 then layers.1,
    // backward reduces layers.1's gradients before layers.0's.
    EXPECT_LT(find_push(events, "FSDP::pre_forward (layers.0)"), find_push(events, "FSDP::pre_forward (layers.1)"));
    EXPECT_LT(find_push(events, "FSDP::post_forward (layers.1)"), find_push(events, "FSDP::pre_backward (layers.1)"));
    EXPECT_LT(find_push(events, "FSDP::reduce_scatter (layers.1)"),
              find_push(events, "FSDP::reduce_scatter (layers.0)"));

    // Every push is popped on its own thread, never more pops than pushes.
    std::map<std::string, int> depth;
    for (const Event& e : events) {
      depth[e.thread] += e.push ? 1 : -1;
      EXPECT_GE(depth[e.thread], 0) << "a pop without a push on thread " << e.thread;
    }
    for (const auto& [thread, open] : depth) EXPECT_EQ(open, 0) << open << " range(s) left open on thread " << thread;
  });
  if (fsdp::testing::is_rank_process()) return;
  if (DIR* d = ::opendir(dir)) {
    while (const dirent* entry = ::readdir(d)) {
      if (entry->d_name[0] != '.') ::unlink((std::string(dir) + "/" + entry->d_name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir);
}

}  // namespace
