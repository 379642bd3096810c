// Link-level proof that fsdp2cpp::checkpoint_fsdp is enough for a program
// that uses checkpoint/fsdp_state.h: its include paths reach both the
// checkpoint and the fsdp2 headers, and the calls resolve in
// libfsdp2cpp_fsdp2. Built by the consumer test, not run (the run is
// tests/checkpoint/training_state_test.cc's, in the main build).
#include <cstdio>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "checkpoint/fsdp_state.h"

int main() {
  torch::nn::Linear model(4, 2);
  torch::optim::AdamW optim(model->parameters());
  fsdp::checkpoint::ModelState model_state(*model);
  fsdp::checkpoint::OptimizerState optim_state(*model, optim);
  fsdp::checkpoint::TrainingState state;
  state.add("model", model_state).add("optim", optim_state);
  std::printf("model state: %zu tensors\n", model_state.state_dict().tensors.size());
  return 0;
}
