// Custom collectives: a module's all-gather and reduce-scatter supplied by
// the user (FSDP2's AllGather / ReduceScatter and
// FSDPModule::set_custom_all_gather / set_custom_reduce_scatter,
// pytorch#155189), and one real use of them, Int8AllGather.
//
// The runtime keeps everything around the collective: the copy-in of the
// shards into one flat input (casting to param_dtype), the copy-out of the
// gathered rows into the unsharded parameters, the reduce-scatter's copy-in
// of the gradients, the divisions, the HSDP all-reduce and the streams and
// events that order them. A custom collective replaces only the buffer
// allocation and the collective call in between
// (tests/fsdp2/fsdp2_custom_collectives_test.cc):
//
//   class CountingAllGather : public AllGather {  // in namespace fsdp
//    public:
//     ...
//     collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
//                                  collectives::Communicator& comm) override {
//       ++calls;
//       return comm.all_gather_into_tensor(output, input);
//     }
//     int64_t calls = 0;
//     ...
//   };
//   ...
//     m.set_custom_all_gather(all_gather);  // one object for every module
//   ...
//       m.set_custom_all_gather(nullptr);  // the default again
//   ...
//     auto int8 = std::make_shared<Int8AllGather>(64);  // the quantized all-gather, blocks of 64
//     m.set_custom_all_gather(int8);
//
// Size and layout conventions (NCCL's, see collectives/communicator.h): for a
// communicator of N ranks, the input is this rank's flat, contiguous chunk of
// n elements (its shards back to back, each padded to ceil(dim0 / N) rows)
// and the output N * n elements, rank r's chunk at [r*n, (r+1)*n). Both are
// 1-D, of the group's param_dtype, on the group's device. The reduce-scatter
// is the converse: input N * n elements of reduce_dtype (rank r's chunk is
// the gradient rows that rank r owns), output n elements.
//
// Streams (CUDA): see each entry point. On CPU there are no streams; Gloo
// runs the collective on its own threads and Work::wait blocks the host.
//
// Which communicator: the module's shard group. After reshard_after_forward
// = k (an integer), the backward's all-gather runs over the group of k
// ranks, from the rows this rank kept after forward (they are the gathered,
// already copied-out values): a custom all-gather must work for any
// communicator it is given.
//
// World size 1: a group with a custom all-gather or reduce-scatter leaves the
// world size 1 fast path (fsdp_param_group.h: at one shard rank the runtime
// otherwise issues no collective and the unsharded parameter is the shard),
// so the custom collective is called at every world size, one rank included:
// a quantized all-gather means the same thing at every world size. FSDP2 in
// Python skips a custom reduce-scatter at one rank; this runtime does not.
//
// Threading: the runtime calls a custom collective from the thread that runs
// the model; one object may serve several modules (the calls never overlap).
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include "collectives/communicator.h"
#include "collectives/reduce_op.h"
#include "collectives/work.h"

namespace fsdp {

// A module's all-gather (FSDP2's AllGather).
class AllGather {
 public:
  virtual ~AllGather();

  // allocate
  //
  // Makes the all-gather output buffer (FSDP2's AllGather.allocate): `sizes`
  // is {N * n}, `dtype` the group's param_dtype, `device` its device. The
  // default is at::empty. Called on the stream that then copies the shards
  // in (the all-gather copy-in stream in implicit prefetch, else the current
  // one), so a buffer from the caching allocator belongs to that stream.
  // REQUIRES (checked, the error names the module): the result is defined,
  // contiguous and of exactly `sizes`, `dtype` and `device`. The runtime
  // copies in, all-gathers, copies out and then drops the buffer.
  virtual at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device);

  // all_gather
  //
  // Gathers every rank's `input` into `output` over `comm` and returns the
  // Work of the collective. `input` holds this rank's chunk (copied in, in
  // param_dtype); it is a view of `output`'s rank-r chunk on NCCL (in place,
  // as the default all-gather) and a buffer of its own on Gloo, so the
  // implementation must read `input` before it writes that chunk of
  // `output` and must not write `input`. Every member of `comm` calls this
  // with equal sizes, in the same order.
  // Streams (CUDA): called with the current stream set to the all-gather
  // stream, which already waits for the copy-in. Work is enqueued there (or
  // on streams ordered after it); the returned Work's wait() is called with
  // that same stream current, and `output` must be valid, on that stream,
  // when wait() returns: a step to run after the collective (a
  // dequantization) belongs in the Work's finishing step (Work::then), which
  // runs inside wait(), on the waiting thread and its current stream.
  // The runtime keeps `input` and `output` alive until wait() returned and
  // orders their reuse after the all-gather stream; buffers of the
  // implementation's own must outlive the collective too (keep them in the
  // finishing step's closure).
  // Errors: an exception thrown here is rethrown naming the module.
  virtual collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                                       collectives::Communicator& comm) = 0;

  // received_bytes
  //
  // What one all_gather of `input_numel` elements of `dtype` over
  // `world_size` ranks makes this rank receive, for
  // RuntimeStats::all_gather_bytes. The default is what a plain all-gather
  // receives: (world_size - 1) * input_numel * elementSize(dtype). Override
  // it when the implementation moves something else (a compressed payload).
  virtual int64_t received_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const;
};

// A module's reduce-scatter (FSDP2's ReduceScatter).
class ReduceScatter {
 public:
  virtual ~ReduceScatter();

  // allocate
  //
  // Makes the reduce-scatter input ({N * n}) and output ({n}) buffers, in
  // the group's reduce_dtype on its device (FSDP2 allocates both through
  // it). The default is at::empty. The input is allocated on the current
  // stream (the copy-in of the gradients runs there) and the output on the
  // reduce-scatter stream. Same REQUIREMENTS as AllGather::allocate.
  // The runtime protects the output across streams with record_stream (the
  // output becomes the sharded gradients, read on the caller's stream),
  // which CUDA applies only to the caching allocator's blocks: memory from
  // elsewhere (a pool of your own, symmetric memory) must stay valid and
  // unreused until the tensor is dropped and every stream that read the
  // gradients made from it is past its use. Give such memory a DataPtr whose
  // deleter returns it to your pool only after an event recorded then.
  virtual at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device);

  // reduce_scatter
  //
  // Reduces `input` over `comm` with `op` and leaves this rank's chunk in
  // `output`; returns the Work. `op` is what the runtime chose for the
  // gradient division (SUM, AVG or PREMUL_SUM, see fully_shard.h's
  // set_gradient_divide_factor); divisions it does not ask of the
  // collective the runtime does itself, before or after. A Gloo
  // communicator computes AVG and PREMUL_SUM as a SUM with a scale in the
  // Work's finishing step, which a pass-through keeps. `input` is not read
  // by the runtime after this call and must stay alive until the Work is
  // waited for (the runtime keeps it).
  // Streams (CUDA): called on the reduce-scatter stream, which already
  // waits for the copy-in; `output` must be valid on the stream current at
  // wait() when wait() returns (the runtime waits with the reduce-scatter
  // stream current).
  // Errors: an exception thrown here is rethrown naming the module.
  virtual collectives::Work reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                           const collectives::ReduceOp& op, collectives::Communicator& comm) = 0;

  // What one reduce_scatter of `input_numel` elements of `dtype` sends from
  // this rank, for RuntimeStats::reduce_scatter_bytes. The default counts the
  // whole input, as the runtime does for its own reduce-scatter.
  virtual int64_t sent_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const;
};

// Int8AllGather: a quantized all-gather (int8 values, one fp32 scale per
// block), for parameters whose forward tolerates a quantization error of
// about 0.4% of each block's largest magnitude.
//
// What it does, per all_gather of n elements per rank over N ranks:
//   1. quantizes this rank's input, block by block (block_size consecutive
//      elements of the flat chunk; the last block may be shorter): scale =
//      max|x| / 127 in fp32, q = round(x / scale) clamped to [-127, 127];
//      a block of zeros gets scale 0 and q = 0 (no division by zero);
//   2. packs the scales and the int8 values into one byte row of
//      row_bytes(n) bytes, [scales: 4 * num_blocks(n)][int8: n][0-3 zero
//      bytes, so that every row starts 4-byte aligned], and all-gathers the
//      rows as ONE uint8 collective (N * row_bytes(n) bytes);
//   3. in the Work's finishing step (inside wait(), on the waiting stream,
//      before the runtime's copy-out) dequantizes every rank's row, its own
//      included, into `output` (q * scale, computed in fp32, cast to the
//      output's dtype), so that every rank holds bit-identical unsharded
//      parameters.
// Traffic: a rank receives (N - 1) * row_bytes(n) bytes, about 1/4 of the
// fp32 all-gather (1/2 of bf16's) plus 4 / block_size per element for the
// scales. Only the all-gather is quantized: the shards the optimizer steps
// on, the gradients and the reduce-scatter keep their dtypes. Error: at most
// scale / 2 per element (half a quantization step), i.e. max|block| / 254,
// plus the rounding to a bf16 output under mixed precision. A block with a
// non-finite value (inf, NaN) dequantizes to non-finite values: a diverged
// model stays visibly diverged. Input dtypes: floating point (fp32, bf16,
// fp16, fp64; quantized from fp32).
// Accuracy of training with it: docs/fsdp2.md, "Custom collectives".
class Int8AllGather : public AllGather {
 public:
  static constexpr int64_t kDefaultBlockSize = 256;
  // REQUIRES: block_size > 0 (throws otherwise).
  explicit Int8AllGather(int64_t block_size = kDefaultBlockSize);

  collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                               collectives::Communicator& comm) override;
  // (world_size - 1) * row_bytes(input_numel).
  int64_t received_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const override;

  int64_t block_size() const { return block_size_; }
  // ceil(numel / block_size).
  int64_t num_blocks(int64_t numel) const;
  // The bytes of one rank's packed row for `numel` elements:
  // 4 * num_blocks(numel) + numel, rounded up to a multiple of 4.
  int64_t row_bytes(int64_t numel) const;

  // The two halves of the collective, for tests and for other transports:
  // quantize(input) packs a 1-D floating-point tensor into a uint8 row of
  // row_bytes(input.numel()) bytes (written into `row`, which must have that
  // size and be on input's device); dequantize(rows, output) unpacks N rows
  // ({N, row_bytes(n)} uint8) into a 1-D `output` of N * n elements.
  void quantize(const at::Tensor& input, const at::Tensor& row) const;
  void dequantize(const at::Tensor& rows, const at::Tensor& output) const;

 private:
  int64_t block_size_;
};

}  // namespace fsdp
