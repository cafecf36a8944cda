// The AutogradCUDA kernel of every dspark op without a derivative (every op but multi_linear, whose derivative
// custom_ops/linear/multi_linear.py registers): with grad mode on, a tensor argument that requires grad raises
// ValueError naming it; otherwise the version counters of the arguments the schema marks written are bumped (the
// kernels write memory directly, so nothing else would: autograd then refuses a backward through a tensor saved
// before the write) and the call goes on below autograd. The same rule and message as
// `custom_ops._library._not_differentiable`, the Python kernel under the Autograd alias key that serves CPU and meta
// tensors (and CUDA ones until this library is loaded); registered directly to AutogradCUDA, this kernel takes
// precedence for CUDA tensors, so an eager CUDA call runs no Python here. docs/contract.md, "Gradients".
// tests/test_not_differentiable.py checks that kNotDifferentiable names exactly the ops registered without a
// derivative.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

namespace dspark {
namespace {

constexpr const char* kNotDifferentiable[] = {
    "_multi_linear_cublas",
    "_multi_linear_variant",
    "dsv4_compress_decode",
    "dsv4_compress_norm_rope_store",
    "dsv4_compress_prefill",
    "dsv4_online_compress_decode",
    "dsv4_online_compress_prefill",
    "dsv4_plan_decode",
    "dsv4_plan_online_decode",
    "dsv4_plan_online_prefill",
    "dsv4_plan_prefill",
    "fused_k_norm_rope_flashmla",
    "fused_norm_rope_inplace",
    "fused_q_indexer_rope_hadamard_quant",
    "fused_q_norm_rope",
    "multi_linear_kv_write",
    "store_flashmla_cache",
};

void bump_versions(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);  // inference tensors have none
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) bump_versions(element);
  }
}

bool requires_grad(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    return t.defined() && t.requires_grad();
  }
  if (value.isList()) {  // Tensor[] and Tensor?[]
    for (const c10::IValue& element : value.toListRef()) {
      if (requires_grad(element)) return true;
    }
  }
  return false;
}

void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  if (c10::GradMode::is_enabled()) {
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (!requires_grad((*stack)[first + i])) continue;
      const std::string qualified = op.schema().name();
      const std::string name = qualified.substr(qualified.find("::") + 2);
      const std::string& arg = arguments[i].name();
      TORCH_CHECK_VALUE(false, name + ": " + arg + " requires grad, but " + qualified +
                                   " has no derivative: call it under torch.no_grad() or torch.inference_mode(), or "
                                   "pass " + arg + ".detach()");
    }
  }
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite()) bump_versions((*stack)[first + i]);
  }
  // no argument requires grad (or grad mode is off), so nothing below records a graph
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace
}  // namespace dspark

TORCH_LIBRARY_IMPL(dspark, AutogradCUDA, m) {
  for (const char* name : dspark::kNotDifferentiable) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&dspark::refuse_grad>());
  }
}
