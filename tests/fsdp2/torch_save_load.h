// torch::save of one module and torch::load into another, through a file, as
// a user checkpoints a sharded model with LibTorch's own serialization.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/serialize.h>

namespace fsdp::test {

// Saves `from` with torch::save to <TempDir>/<name>_<pid>.pt, loads the file
// into `into` with torch::load, and removes it.
inline void torch_save_and_load(const std::shared_ptr<torch::nn::Module>& from, std::shared_ptr<torch::nn::Module> into,
                                const std::string& name) {
  const std::string path = ::testing::TempDir() + "/" + name + "_" + std::to_string(::getpid()) + ".pt";
  torch::save(from, path);
  torch::load(into, path);
  std::remove(path.c_str());
}

}  // namespace fsdp::test
