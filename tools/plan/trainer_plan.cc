#include "trainer_plan.h"

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <c10/util/Exception.h>

#include "fsdp2/activation_checkpoint.h"
#include "fsdp2/clip_grad.h"
#include "init.h"
#include "trainer.h"

namespace fsdp_plan_tool {
namespace {

template <typename T>
T value_or_throw(absl::StatusOr<T> value) {
  TORCH_CHECK(value.ok(), "fsdp_plan: ", value.status().message());
  return *std::move(value);
}

}  // namespace

ShardedTrainer shard_trainer(const fsdp_train::TrainConfig& c, const fsdp::DeviceMesh& mesh,
                             const c10::Device& device) {
  const fsdp_train::ModelConfig mc = fsdp_train::model_config(c);

  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  options.mp_policy.param_dtype = value_or_throw(fsdp_train::parse_dtype("param-dtype", c.param_dtype));
  options.mp_policy.reduce_dtype = value_or_throw(fsdp_train::parse_dtype("reduce-dtype", c.reduce_dtype));
  options.offload_policy.offload_to_cpu = c.cpu_offload;
  fsdp::FullyShardOptions block_options = options;
  block_options.reshard_after_forward = c.reshard_after_forward;
  const fsdp::CheckpointOptions ac_options = fsdp_train::checkpoint_options(c);
  int64_t block_index = 0;
  const std::function<void(fsdp_train::Block&)> on_block = [&](fsdp_train::Block& block) {
    if (c.ac != "none" && block_index % c.ac_every == 0) fsdp::checkpoint_module(*block, ac_options);
    ++block_index;
    fsdp::fully_shard(block, block_options);
  };
  ShardedTrainer t;
  t.device = device;
  t.model = fsdp_train::build_transformer(mc, c.seed, device, on_block);
  t.root = fsdp::fully_shard(t.model, options);
  fsdp_train::set_block_prefetch(*t.model, c.prefetch);
  t.optim = std::make_unique<torch::optim::AdamW>(
      t.model->parameters(), torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(c.weight_decay));
  t.parameters = fsdp_train::parameter_count(mc);
  for (const auto& p : t.model->parameters()) t.local_parameters += p.numel();
  return t;
}

void train_step(ShardedTrainer& t, const fsdp_train::TrainConfig& c, int64_t local_batch,
                const std::function<void(fsdp_plan::StepPhase)>& on_phase) {
  const auto phase = [&](fsdp_plan::StepPhase p) {
    if (on_phase) on_phase(p);
  };
  const c10::Device device = t.device;
  phase(fsdp_plan::StepPhase::kForward);
  t.optim->zero_grad();
  const at::Tensor inputs =
      at::randint(t.model->config.vocab, {local_batch, c.seq_len}, at::device(device).dtype(at::kLong));
  const at::Tensor targets =
      at::randint(t.model->config.vocab, {local_batch, c.seq_len}, at::device(device).dtype(at::kLong));
  at::Tensor logits = fsdp::call_module(*t.model, inputs);
  at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
  logits.reset();
  phase(fsdp_plan::StepPhase::kBackward);
  loss.backward();
  loss.reset();
  phase(fsdp_plan::StepPhase::kOptimizer);
  if (c.clip > 0) fsdp::clip_grads_with_norm_(*t.root, c.clip, fsdp::get_total_norm(*t.root));
  t.optim->step();
}

TrainerPlan plan_trainer(const fsdp_train::TrainConfig& config, fsdp_plan::DryRunOptions options, int64_t local_batch,
                         int steps) {
  const fsdp_train::TrainConfig& c = config;
  const absl::Status valid = fsdp_train::validate_model(c);
  TORCH_CHECK(valid.ok(), valid.message());
  TORCH_CHECK(local_batch >= 1, "fsdp_plan: the local batch must be at least 1 sequence (got ", local_batch, ")");
  TORCH_CHECK(steps >= 1, "fsdp_plan: at least one step must run (got ", steps, ")");
  const fsdp_train::MeshShape shape = value_or_throw(fsdp_train::parse_mesh(c.mesh, options.world_size));
  options.mesh_shape.clear();
  if (shape.replicate > 1) options.mesh_shape = {shape.replicate, shape.shard};
  TrainerPlan plan;
  fsdp_plan::DryRun dry(options);
  {
    ShardedTrainer t = shard_trainer(c, dry.mesh(), c10::Device(c10::kMeta));
    plan.parameters = t.parameters;
    plan.local_parameters = t.local_parameters;
    plan.embedding_parameters = t.model->config.vocab * t.model->config.dim;
    dry.track(t.model);
    for (int step = 0; step < steps; ++step) {
      train_step(t, c, local_batch, [&](fsdp_plan::StepPhase p) { dry.begin(p); });
    }
    plan.memory = dry.memory();
  }
  plan.collectives = dry.collectives();
  plan.ops = dry.ops();
  return plan;
}

fsdp_plan::StepTime simulate_trainer(const TrainerPlan& plan, const fsdp_train::TrainConfig& c, int64_t local_batch,
                                     int steps, const fsdp_plan::DeviceProfile& profile) {
  fsdp_plan::TimelineOptions t;
  t.device = profile;
  t.tokens = local_batch * c.seq_len;
  const double per_token = 6.0 * static_cast<double>(plan.parameters - plan.embedding_parameters) +
                           12.0 * static_cast<double>(c.layers * c.dim * c.seq_len);
  t.model_flops = per_token * static_cast<double>(t.tokens);
  return fsdp_plan::simulate(plan.ops, steps, t);
}

int64_t largest_local_batch(const fsdp_train::TrainConfig& config, const fsdp_plan::DryRunOptions& options,
                            int64_t memory_bytes, int64_t max_batch) {
  const fsdp_train::TrainConfig& c = config;
  const auto fits = [&](int64_t batch) {
    return plan_trainer(c, options, batch, /*steps=*/2).memory.peak_reserved <= memory_bytes;
  };
  if (!fits(1)) return 0;
  int64_t good = 1, bad = 0;
  while (bad == 0 && good < max_batch) {
    const int64_t next = std::min(max_batch, good * 2);
    if (fits(next)) {
      good = next;
    } else {
      bad = next;
    }
  }
  while (bad != 0 && bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    if (fits(mid)) {
      good = mid;
    } else {
      bad = mid;
    }
  }
  return good;
}

}  // namespace fsdp_plan_tool
