// Checks of every Communicator operation, shared by the CPU (Gloo) and GPU
// (NCCL, Gloo on CUDA tensors) tests. Each check runs on every member of a
// group, computes the expected result on its own from the rank-indexed input
// formula (never from another rank's data), and asserts values.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "collectives/communicator.h"
#include "collectives/reduce_op.h"

namespace fsdp::collectives::testing {

// The value that group rank `r` holds at flat index `j`. Small integers for
// bf16 (every sum over 4 ranks stays below 256, so bf16 holds it exactly),
// values above 2^32 for int64 (so that a 32-bit truncation shows).
inline double input_value(int r, int64_t j, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return (r + 1) * 8 + (j % 29);
  if (dtype == at::kLong) return (r + 1) * 1e12 + j;
  return (r + 1) * 1000 + j;
}

// Rank r's input of `numel` elements, starting at flat index `offset`.
inline at::Tensor rank_input(int r, int64_t numel, at::ScalarType dtype, c10::Device device, int64_t offset = 0) {
  std::vector<double> values(numel);
  for (int64_t j = 0; j < numel; ++j) values[j] = input_value(r, offset + j, dtype);
  return at::tensor(values, at::kDouble).to(device, dtype);
}

// The reduction of input_value over `size` ranks at flat indices
// [offset, offset + numel), in double.
inline at::Tensor expected_reduction(int size, int64_t offset, int64_t numel, at::ScalarType dtype,
                                     const ReduceOp& op) {
  std::vector<double> out(numel);
  for (int64_t j = 0; j < numel; ++j) {
    double acc = 0;
    for (int r = 0; r < size; ++r) {
      const double x = input_value(r, offset + j, dtype);
      switch (op.kind()) {
        case ReduceOp::Kind::kSum:
        case ReduceOp::Kind::kAvg: acc += x; break;
        case ReduceOp::Kind::kPremulSum: acc += op.factor() * x; break;
        case ReduceOp::Kind::kMax: acc = r == 0 ? x : std::max(acc, x); break;
        case ReduceOp::Kind::kMin: acc = r == 0 ? x : std::min(acc, x); break;
      }
    }
    if (op.kind() == ReduceOp::Kind::kAvg) acc /= size;
    out[j] = acc;
  }
  return at::tensor(out, at::kDouble);
}

// Exact for every op whose result the dtype represents exactly (all but AVG
// here); AVG within one rounding of the dtype.
inline void expect_reduced(const at::Tensor& actual, const at::Tensor& expected_double, at::ScalarType dtype,
                           const ReduceOp& op, const std::string& what) {
  ASSERT_EQ(actual.scalar_type(), dtype) << what;
  const at::Tensor got = actual.cpu();
  if (op.kind() == ReduceOp::Kind::kAvg) {
    const double rtol = dtype == at::kBFloat16 ? 1e-2 : 1e-6;
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected_double, rtol, /*atol=*/0))
        << what << "\n got " << got << "\n expected " << expected_double;
  } else {
    EXPECT_TRUE(got.equal(expected_double.to(dtype)))
        << what << "\n got " << got << "\n expected " << expected_double.to(dtype);
  }
}

struct DtypeOps {
  at::ScalarType dtype;
  std::vector<ReduceOp> ops;
};

// fp32 and bf16 with every op; int64 with SUM and MAX (AVG and PREMUL_SUM
// are refused for integers, see communicator.h).
inline std::vector<DtypeOps> dtype_ops() {
  const std::vector<ReduceOp> all = {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::premul_sum(0.25), ReduceOp::max(),
                                     ReduceOp::min()};
  return {{at::kFloat, all}, {at::kBFloat16, all}, {at::kLong, {ReduceOp::sum(), ReduceOp::max()}}};
}

// A reduction in flight, and the tensors it reads and writes (one tensor for
// an in-place all-reduce).
struct InFlight {
  Work work;
  at::Tensor input;
  at::Tensor output;
  at::ScalarType dtype;
  ReduceOp op;
};

// `issue(dtype, op)` for every pair of dtype_ops(), all issued before any is
// waited for: several collectives in flight at once.
template <typename Issue>
std::vector<InFlight> issue_for_every_dtype_op(Issue&& issue) {
  std::vector<InFlight> pending;
  for (const DtypeOps& d : dtype_ops()) {
    for (const ReduceOp& op : d.ops) pending.push_back(issue(d.dtype, op));
  }
  return pending;
}

inline std::string label(const Communicator& comm, at::ScalarType dtype, const std::string& what) {
  return what + " " + std::string(c10::toString(dtype)) + " on " + comm.name() + " as group rank " +
         std::to_string(comm.rank());
}

// Output holds rank r's input at [r*n, (r+1)*n), for sizes that do not divide
// by the group size, a single element and no element; also in place (input
// is output's own slice).
inline void check_all_gather(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (int64_t n : {5, 1, 0}) {
      const std::string what = label(comm, dtype, "all_gather_into_tensor n=" + std::to_string(n));
      at::Tensor input = rank_input(rank, n, dtype, device);
      at::Tensor output = at::full({size * n}, -1, at::TensorOptions().dtype(dtype).device(device));
      comm.all_gather_into_tensor(output, input).wait();
      at::Tensor expected = at::empty({size * n}, at::TensorOptions().dtype(dtype));
      for (int r = 0; r < size; ++r) expected.narrow(0, r * n, n).copy_(rank_input(r, n, dtype, c10::kCPU));
      EXPECT_TRUE(output.cpu().equal(expected)) << what << "\n got " << output.cpu() << "\n expected " << expected;

      at::Tensor in_place = at::full({size * n}, -1, at::TensorOptions().dtype(dtype).device(device));
      in_place.narrow(0, rank * n, n).copy_(input);
      comm.all_gather_into_tensor(in_place, in_place.narrow(0, rank * n, n)).wait();
      EXPECT_TRUE(in_place.cpu().equal(expected)) << what << " (in place)\n got " << in_place.cpu();
    }
  }
}

// Rank r gets the reduction of every rank's input[r*n : (r+1)*n], for every
// op and for chunks of 7, 1 and 0 elements; also in place (output is input's
// own slice).
inline void check_reduce_scatter(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  for (const DtypeOps& d : dtype_ops()) {
    for (const ReduceOp& op : d.ops) {
      for (int64_t n : {7, 1, 0}) {
        const std::string what =
            label(comm, d.dtype, "reduce_scatter_tensor(" + op.to_string() + ") n=" + std::to_string(n));
        const at::Tensor expected = expected_reduction(size, rank * n, n, d.dtype, op);

        at::Tensor input = rank_input(rank, size * n, d.dtype, device);
        at::Tensor output = at::full({n}, -1, at::TensorOptions().dtype(d.dtype).device(device));
        comm.reduce_scatter_tensor(output, input, op).wait();
        expect_reduced(output, expected, d.dtype, op, what);

        at::Tensor in_place = rank_input(rank, size * n, d.dtype, device);
        at::Tensor slice = in_place.narrow(0, rank * n, n);
        comm.reduce_scatter_tensor(slice, in_place, op).wait();
        expect_reduced(slice, expected, d.dtype, op, what + " (in place)");
      }
    }
  }
}

// Several reduce-scatters in flight at once, waited for in reverse order of
// issue, each waited for twice; the inputs are overwritten right after the
// waits (nothing may still read them) and a second wait must not reduce or
// scale again.
inline void check_reduce_scatters_in_flight(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  constexpr int64_t kChunk = 5;
  std::vector<InFlight> pending = issue_for_every_dtype_op([&](at::ScalarType dtype, const ReduceOp& op) {
    at::Tensor input = rank_input(rank, size * kChunk, dtype, device);
    at::Tensor output = at::full({kChunk}, -1, at::TensorOptions().dtype(dtype).device(device));
    Work work = comm.reduce_scatter_tensor(output, input, op);
    return InFlight{std::move(work), input, output, dtype, op};
  });
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
    const std::string what = label(comm, it->dtype, "reduce_scatter_tensor(" + it->op.to_string() + ") in flight");
    it->work.wait();
    it->input.fill_(-7);
    it->work.wait();
    EXPECT_TRUE(it->work.is_completed()) << what;
    expect_reduced(it->output, expected_reduction(size, rank * kChunk, kChunk, it->dtype, it->op), it->dtype, it->op,
                   what);
  }
}

// All (dtype, op) pairs are issued before any is waited for: several
// collectives in flight at once.
inline void check_all_reduce(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  constexpr int64_t kNumel = 5;
  std::vector<InFlight> pending = issue_for_every_dtype_op([&](at::ScalarType dtype, const ReduceOp& op) {
    at::Tensor t = rank_input(rank, kNumel, dtype, device);
    Work work = comm.all_reduce(t, op);
    return InFlight{std::move(work), t, t, dtype, op};
  });
  for (InFlight& p : pending) {
    const std::string what = label(comm, p.dtype, "all_reduce(" + p.op.to_string() + ")");
    EXPECT_NE(p.work.description().find("all_reduce(" + p.op.to_string() + ") on " + comm.name()), std::string::npos)
        << p.work.description();
    p.work.wait();
    // A second wait must not apply the AVG / PREMUL_SUM scale again.
    p.work.wait();
    EXPECT_TRUE(p.work.is_completed()) << what;
    EXPECT_EQ(p.work.exception(), nullptr) << what;
    expect_reduced(p.output, expected_reduction(size, 0, kNumel, p.dtype, p.op), p.dtype, p.op, what);
  }
}

// Every group rank takes a turn as the root.
inline void check_broadcast(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (int root = 0; root < size; ++root) {
      const std::string what = label(comm, dtype, "broadcast from root " + std::to_string(root));
      at::Tensor t = rank == root ? rank_input(root, 5, dtype, device)
                                  : at::full({5}, -1, at::TensorOptions().dtype(dtype).device(device));
      comm.broadcast(t, root).wait();
      EXPECT_TRUE(t.cpu().equal(rank_input(root, 5, dtype, c10::kCPU))) << what << "\n got " << t.cpu();
    }
  }
}

// Several pairs of different sizes and dtypes in one call; the result of each
// pair is that of the single-tensor collective.
inline void check_coalesced(Communicator& comm, c10::Device device) {
  const int size = comm.size();
  const int rank = comm.rank();
  const std::vector<int64_t> numels = {5, 1, 3};
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kLong};
  {
    std::vector<at::Tensor> inputs, outputs;
    for (size_t i = 0; i < numels.size(); ++i) {
      inputs.push_back(rank_input(rank, numels[i], dtypes[i], device));
      outputs.push_back(at::full({size * numels[i]}, -1, at::TensorOptions().dtype(dtypes[i]).device(device)));
    }
    comm.all_gather_into_tensor_coalesced(outputs, inputs).wait();
    for (size_t i = 0; i < numels.size(); ++i) {
      at::Tensor expected = at::empty({size * numels[i]}, at::TensorOptions().dtype(dtypes[i]));
      for (int r = 0; r < size; ++r) {
        expected.narrow(0, r * numels[i], numels[i]).copy_(rank_input(r, numels[i], dtypes[i], c10::kCPU));
      }
      EXPECT_TRUE(outputs[i].cpu().equal(expected))
          << label(comm, dtypes[i], "all_gather_into_tensor_coalesced pair " + std::to_string(i)) << "\n got "
          << outputs[i].cpu() << "\n expected " << expected;
    }
  }
  for (const ReduceOp& op : {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::premul_sum(0.25), ReduceOp::max()}) {
    const std::vector<int64_t> chunks = {7, 2, 1};
    const std::vector<at::ScalarType> float_dtypes = {at::kFloat, at::kBFloat16, at::kFloat};
    std::vector<at::Tensor> inputs, outputs;
    for (size_t i = 0; i < chunks.size(); ++i) {
      inputs.push_back(rank_input(rank, size * chunks[i], float_dtypes[i], device));
      outputs.push_back(at::full({chunks[i]}, -1, at::TensorOptions().dtype(float_dtypes[i]).device(device)));
    }
    Work work = comm.reduce_scatter_tensor_coalesced(outputs, inputs, op);
    work.wait();
    work.wait();
    for (size_t i = 0; i < chunks.size(); ++i) {
      expect_reduced(outputs[i], expected_reduction(size, rank * chunks[i], chunks[i], float_dtypes[i], op),
                     float_dtypes[i], op,
                     label(comm, float_dtypes[i],
                           "reduce_scatter_tensor_coalesced(" + op.to_string() + ") pair " + std::to_string(i)));
    }
  }
  // Nothing to do is a completed work, not an error.
  Work empty = comm.all_gather_into_tensor_coalesced({}, {});
  EXPECT_TRUE(empty.is_completed());
  empty.wait();
}

}  // namespace fsdp::collectives::testing
