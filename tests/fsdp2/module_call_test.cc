// The module-call hook facility (single process).
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "fsdp2/module_call.h"

namespace fsdp {
namespace {

struct PairImpl : torch::nn::Module {
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& x, std::vector<at::Tensor> ys, double scale,
                                                          std::optional<at::Tensor> z) {
    for (auto& y : ys) y = y * scale;
    return {x + (z ? *z : at::zeros_like(x)), ys};
  }
};
FSDP2CPP_MODULE(Pair);

TEST(ModuleCall, ModulesWithoutHooksAreCalledDirectly) {
  auto linear = torch::nn::Linear(3, 2);
  at::Tensor x = at::randn({4, 3});
  EXPECT_TRUE(call_module(linear, x).equal(linear(x)));
  EXPECT_FALSE(has_forward_hooks(*linear));
}

TEST(ModuleCall, HooksSeeAndReplaceEveryTensorInNestedArguments) {
  Pair pair;
  std::vector<std::string> calls;
  size_t seen_inputs = 0, seen_outputs = 0;
  const HookId pre = register_forward_pre_hook(*pair, [&](torch::nn::Module&, TensorRefs& inputs) {
    calls.push_back("pre");
    seen_inputs = inputs.size();
    *inputs[0] = *inputs[0] + 100;  // replaces x
  });
  register_forward_hook(*pair, [&](torch::nn::Module&, TensorRefs&, TensorRefs& outputs) {
    calls.push_back("post");
    seen_outputs = outputs.size();
    *outputs.back() = at::zeros({1});  // replaces the last y
  });
  at::Tensor x = at::ones({2});
  auto [sum, ys] = pair(x, std::vector<at::Tensor>{at::ones({1}), at::ones({1})}, 2.0, at::ones({2}));
  EXPECT_EQ(calls, (std::vector<std::string>{"pre", "post"}));
  EXPECT_EQ(seen_inputs, 4u);   // x, two ys, z
  EXPECT_EQ(seen_outputs, 3u);  // sum, two ys
  EXPECT_TRUE(sum.equal(at::full({2}, 102.0)));
  EXPECT_TRUE(ys[0].equal(at::full({1}, 2.0)));
  EXPECT_TRUE(ys[1].equal(at::zeros({1})));
  EXPECT_TRUE(x.equal(at::ones({2}))) << "the caller's tensor is not modified";
  remove_hook(*pair, pre);
  EXPECT_THROW(remove_hook(*pair, pre), c10::Error);
}

TEST(ModuleCall, SequentialRunsEachChildThroughItsHooks) {
  auto first = torch::nn::Linear(3, 3);
  auto second = torch::nn::Tanh();
  Sequential seq(first, second);
  std::vector<std::string> order;
  register_forward_pre_hook(*first, [&](torch::nn::Module&, TensorRefs&) { order.push_back("first"); });
  register_forward_pre_hook(*second, [&](torch::nn::Module&, TensorRefs&) { order.push_back("second"); });
  register_forward_pre_hook(*seq, [&](torch::nn::Module&, TensorRefs&) { order.push_back("sequential"); });
  at::Tensor x = at::randn({2, 3});
  at::Tensor y = seq(x);
  EXPECT_EQ(order, (std::vector<std::string>{"sequential", "first", "second"}));
  EXPECT_TRUE(y.allclose(at::tanh(first(x))));
  // A plain torch::nn::Sequential holder goes through the hooks too.
  torch::nn::Sequential plain(first);
  call_module(plain, x);
  EXPECT_EQ(order.back(), "first");
}

TEST(ModuleCall, ErrorHooksSeeTheForwardsExceptionAndMayReplaceIt) {
  auto linear = torch::nn::Linear(3, 2);
  const at::Tensor wrong = at::randn({2, 5});
  std::vector<std::string> seen;
  const HookId observe = register_forward_error_hook(*linear, [&](torch::nn::Module&) {
    try {
      throw;
    } catch (const c10::Error& e) {
      seen.push_back(e.what_without_backtrace());
    }
  });
  // A hook that returns lets the original exception through.
  try {
    call_module(linear, wrong);
    ADD_FAILURE() << "expected the shape error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be multiplied"), std::string::npos) << e.what();
  }
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_NE(seen[0].find("cannot be multiplied"), std::string::npos) << seen[0];
  // A hook that throws replaces it, also for a child of a Sequential.
  register_forward_error_hook(*linear, [](torch::nn::Module&) { throw std::runtime_error("explained"); });
  Sequential seq(linear);
  EXPECT_THROW(
      {
        try {
          seq(wrong);
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "explained");
          throw;
        }
      },
      std::runtime_error);
  EXPECT_EQ(seen.size(), 2u);
  // Errors of the hooks themselves do not run the error hooks, and a call
  // that succeeds runs none.
  call_module(linear, at::randn({2, 3}));
  EXPECT_EQ(seen.size(), 2u);
  remove_hook(*linear, observe);
  EXPECT_THROW(remove_hook(*linear, observe), c10::Error);
}

TEST(ModuleCall, HooksDieWithTheirModule) {
  std::weak_ptr<int> alive;
  {
    auto linear = torch::nn::Linear(2, 2);
    auto token = std::make_shared<int>(1);
    alive = token;
    register_forward_pre_hook(*linear, [token](torch::nn::Module&, TensorRefs&) {});
  }
  // The next registration sweeps entries of destroyed modules.
  auto other = torch::nn::Linear(2, 2);
  register_forward_pre_hook(*other, [](torch::nn::Module&, TensorRefs&) {});
  EXPECT_TRUE(alive.expired());
}

TEST(ModuleCall, ModulesNotOwnedBySharedPtrAreRejected) {
  torch::nn::LinearImpl on_stack(2, 2);
  EXPECT_THROW(register_forward_pre_hook(on_stack, [](torch::nn::Module&, TensorRefs&) {}), c10::Error);
}

}  // namespace
}  // namespace fsdp
