// compile_rng's kernels for torch's random ops at the backend keys, in C++ (built at first
// use by compile_rng/eager/native_kernels.py).
//
// Each kernel wraps torch's own kernel for its (op, backend key). Outside every stream it
// calls that kernel at once: no Python, and the GIL stays released as the op's binding
// released it (torch 2.11/2.12: taken for a moment to read the thread's cell, below). Inside a stream - the thread's state holds compile_rng's handler, which the
// autograd engine hands its device threads too - it calls compile_rng's Python kernel for
// the op (registered at a dispatch key no dispatch reaches), which draws from the stream.
//
// Private torch C++ API, checked on torch 2.11-2.15: at::impl::ThreadLocalPythonObjects
// (the thread state torch._C._stash_obj_in_tls writes) and
// c10::OperatorHandle::getComputedKernelForDispatchKey (torch.library.get_kernel's).

#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

namespace {

// The key of compile_rng's handler in the thread state (compile_rng.eager.random_kernels).
const std::string kHandlerKey = "compile_rng_random_op_handler";

// Whether the thread is in a stream. torch 2.13+ removes the key outside streams: no GIL.
// torch 2.11 and 2.12 cannot remove a key, so there the thread keeps one cell (an object
// with a `value` slot, compile_rng._torch.core_internals._Cell) whose value is None outside
// a stream: reading it takes the GIL for that moment, never for the draw.
bool in_stream() {
  if (!at::impl::ThreadLocalPythonObjects::contains(kHandlerKey)) {
    return false;
  }
  const auto& held = at::impl::ThreadLocalPythonObjects::get(kHandlerKey);
  pybind11::gil_scoped_acquire gil;
  PyObject* object = held->ptr(&held->pyinterpreter());
  if (!PyObject_HasAttrString(object, "value")) {
    return true;
  }
  PyObject* value = PyObject_GetAttrString(object, "value");
  const bool drawing = value != nullptr && value != Py_None;
  Py_XDECREF(value);
  return drawing;
}

class RandomOpKernel final : public c10::OperatorKernel {
 public:
  RandomOpKernel(c10::SafeKernelFunction stock, c10::SafeKernelFunction stream)
      : stock_(std::move(stock)), stream_(std::move(stream)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (in_stream()) {
      stream_.callBoxed(op, keys, stack);
    } else {
      stock_.callBoxed(op, keys, stack);
    }
  }

 private:
  c10::SafeKernelFunction stock_;
  c10::SafeKernelFunction stream_;
};

// A warning handler that drops torch's "Overriding a previously registered kernel": here
// that is the point, and the kernel calls the one it overrides.
class Quiet final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

std::vector<std::unique_ptr<torch::Library>> libraries;

// Wrap op `name`.`overload`'s kernel at each of `keys` (backend keys where torch has one);
// in a stream they call the op's kernel at `stream_key` (compile_rng's Python kernel).
void serve(const std::string& name, const std::string& overload, const std::vector<std::string>& keys,
           const std::string& stream_key) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  auto stream = op.getComputedKernelForDispatchKey(c10::parseDispatchKey(stream_key));
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  const std::string qualified = name.substr(name.find("::") + 2) + (overload.empty() ? "" : "." + overload);
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  for (const auto& key : keys) {
    const auto k = c10::parseDispatchKey(key);
    library->impl(qualified.c_str(), torch::dispatch(k, torch::CppFunction::makeFromBoxedFunctor(
        std::make_unique<RandomOpKernel>(op.getComputedKernelForDispatchKey(k), stream))));
  }
  libraries.push_back(std::move(library));
}

// Remove every kernel serve() registered.
void clear() { libraries.clear(); }

}  // namespace

PYBIND11_MODULE(COMPILE_RNG_MODULE, m) {
  m.def("serve", &serve);
  m.def("clear", &clear);
}
