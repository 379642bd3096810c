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

// A module used through methods other than forward.
struct CodecImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    ++forwards;
    return x;
  }
  std::pair<at::Tensor, at::Tensor> encode(const at::Tensor& x, double scale) { return {x * scale, x + 1}; }
  at::Tensor decode(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() == 1, "decode needs a vector");
    return x - 1;
  }
  int forwards = 0;
};
FSDP2CPP_MODULE(Codec);

TEST(ModuleCall, MethodsRunTheForwardHooksAroundThem) {
  Codec codec;
  const at::Tensor x = at::ones({2});
  // Without hooks: a direct call.
  auto [scaled, shifted] = call_module_method(codec, &CodecImpl::encode, x, 3.0);
  EXPECT_TRUE(scaled.equal(at::full({2}, 3.0)));
  EXPECT_TRUE(shifted.equal(at::full({2}, 2.0)));

  std::vector<std::string> calls;
  register_forward_pre_hook(*codec, [&](torch::nn::Module& m, TensorRefs& inputs) {
    EXPECT_EQ(&m, codec.ptr().get());
    calls.push_back("pre " + std::to_string(inputs.size()));
    *inputs[0] = *inputs[0] * 10;  // replaces x
  });
  register_forward_hook(*codec, [&](torch::nn::Module&, TensorRefs& inputs, TensorRefs& outputs) {
    calls.push_back("post " + std::to_string(inputs.size()) + " " + std::to_string(outputs.size()));
    *outputs[0] = *outputs[0] + 0.5;  // replaces the first result
  });
  std::vector<std::string> errors;
  register_forward_error_hook(*codec, [&](torch::nn::Module&) { errors.push_back("error"); });

  // On the holder and on the Impl alike; the tensor arguments and results
  // are what the hooks see, the plain ones are passed through.
  std::tie(scaled, shifted) = call_module_method(codec, &CodecImpl::encode, x, 3.0);
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 1", "post 1 2"}));
  EXPECT_TRUE(scaled.equal(at::full({2}, 30.5)));
  EXPECT_TRUE(shifted.equal(at::full({2}, 11.0)));
  EXPECT_TRUE(x.equal(at::ones({2}))) << "the caller's tensor is not modified";
  calls.clear();
  at::Tensor decoded = call_module_method(*codec, &CodecImpl::decode, x);  // a const method
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 1", "post 1 1"}));
  EXPECT_TRUE(decoded.equal(at::full({2}, 9.5)));
  EXPECT_EQ(codec->forwards, 0) << "forward is not called";
  EXPECT_TRUE(errors.empty());

  // A method that throws runs the error hooks, not the post-hooks.
  calls.clear();
  EXPECT_THROW(call_module_method(codec, &CodecImpl::decode, at::ones({2, 2})), c10::Error);
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 1"}));
  EXPECT_EQ(errors, (std::vector<std::string>{"error"}));

  // forward through call_module runs the same hooks.
  calls.clear();
  EXPECT_TRUE(codec(x).equal(at::full({2}, 10.5)));
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 1", "post 1 1"}));
  EXPECT_EQ(codec->forwards, 1);
}

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
