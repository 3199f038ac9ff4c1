// compile_rng's kernels for torch's random ops at the backend keys, in C++ (built at first
// use by compile_rng/eager/native_kernels.py).
//
// Each kernel wraps torch's own kernel for its (op, backend key). Outside every stream it
// calls that kernel at once: no Python, and the GIL stays released as the op's binding
// released it (torch 2.11/2.12: taken for a moment to read the thread's cell, below). Inside a stream - the thread's state holds compile_rng's handler, which the
// autograd engine hands its device threads too - it calls compile_rng's Python kernel for
// the op (registered at a dispatch key no dispatch reaches), which draws from the stream.
// One op has a lane here too: dropout's bernoulli_(p) on a plain dense float32 CPU tensor in
// the eager stream takes its counters from one Python call (compile_rng.eager.short_draws.
// lane_counter, on the Python kernel's own path) and is filled by compile_rng's CPU kernel
// with the GIL released, skipping the Python kernel's layers (~13 us a call on a Xeon core).
// Anything the lane does not serve takes the Python kernel as before.
//
// Private torch C++ API, checked on torch 2.11-2.15: at::impl::ThreadLocalPythonObjects
// (the thread state torch._C._stash_obj_in_tls writes),
// c10::OperatorHandle::getComputedKernelForDispatchKey (torch.library.get_kernel's) and
// c10::impl::TorchDispatchModeTLS::stack_len (torch.utils._python_dispatch's mode stack).

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <unordered_set>
#include <string>
#include <vector>

namespace {

// The key of compile_rng's handler in the thread state (compile_rng.eager.random_kernels).
const std::string kHandlerKey = "compile_rng_random_op_handler";

// The thread's stream object (compile_rng.eager.random_kernels._Drawing) as a new
// reference, or nullptr outside a stream; the GIL held. torch 2.13+ removes the key outside
// streams, so a caller checks `contains` first and takes no GIL there. torch 2.11 and 2.12
// cannot remove a key, so there the thread keeps one cell (an object with a `value` slot,
// compile_rng._torch.core_internals._Cell) whose value is None outside a stream: reading it
// takes the GIL for that moment, never for the draw.
PyObject* drawing_here() {
  const auto& held = at::impl::ThreadLocalPythonObjects::get(kHandlerKey);
  PyObject* object = held->ptr(&held->pyinterpreter());
  if (!PyObject_HasAttrString(object, "value")) {
    Py_INCREF(object);
    return object;
  }
  PyObject* value = PyObject_GetAttrString(object, "value");
  if (value == Py_None) {
    Py_DECREF(value);
    return nullptr;
  }
  return value;
}

// compile_rng's CPU kernel for contiguous float32 streams (cr_fast_f32 in
// compile_rng/stream/csrc/philox.c; op 1: W < threshold)
using FastF32 = int (*)(int, float*, uint8_t*, const float*, int64_t, uint64_t, uint64_t, float, float, float,
                        uint64_t, float, int);

// What the lane calls, from set_lane (owned references; the module keeps them until clear()).
struct Lane {
  PyObject* handler = nullptr;   // the eager stream's handler: only its draws take the lane
  // compile_rng.eager.short_draws, whose lane_counter - (seed, first counter) or None - is
  // read per call, so that it can be replaced (the tests switch the lane off so)
  PyObject* counters = nullptr;
  PyObject* dynamo_hook = nullptr;  // returns Dynamo's frame hook, None when off
  FastF32 fill = nullptr;
  // the code objects whose frames change a draw (draw_counters.watched_codes): with one on
  // the stack the Python kernel serves it
  std::unordered_set<uintptr_t> watched;
};
Lane lane;

// Whether a frame on this thread's Python stack runs one of the lane's watched codes.
bool watched_frame_on_stack() {
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const bool watched = lane.watched.count(reinterpret_cast<uintptr_t>(code)) != 0;
    Py_DECREF(code);
    if (watched) {
      Py_DECREF(frame);
      return true;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  return false;
}

// Whether `object.name` is `expected` (identity), or, without one, the int `ident`.
bool attribute_is(PyObject* object, PyObject* name, PyObject* expected, unsigned long ident = 0) {
  PyObject* value = PyObject_GetAttr(object, name);
  if (value == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool same = expected != nullptr ? value == expected
                                  : PyLong_Check(value) && PyLong_AsUnsignedLong(value) == ident;
  if (PyErr_Occurred()) {
    PyErr_Clear();
    same = false;
  }
  Py_DECREF(value);
  return same;
}

// bernoulli_(self, p, generator) on the lane, the GIL held: true with the counters of the
// draw reserved in `seed`/`first`; false where the Python kernel serves it (nothing reserved).
// A Python error from the counters (a refused draw) is raised as the Python kernel raises it.
bool reserve_on_lane(PyObject* drawing, const torch::jit::Stack& stack, uint64_t& seed, uint64_t& first) {
  const auto n = stack.size();
  const at::Tensor& self = stack[n - 3].toTensor();
  const c10::IValue& p = stack[n - 2];
  if (!stack[n - 1].isNone() || !p.isDouble() || !(p.toDouble() >= 0.0 && p.toDouble() <= 1.0)) {
    return false;
  }
  if (self.device().type() != c10::kCPU || self.scalar_type() != at::kFloat || self.layout() != c10::kStrided ||
      !self.is_contiguous() || self.key_set().has(c10::DispatchKey::Python) ||
      c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    return false;
  }
  // Dynamo's frame hook would compile the counters' Python frames: the Python kernel turns it off
  PyObject* hook = PyObject_CallNoArgs(lane.dynamo_hook);
  if (hook == nullptr) {
    throw pybind11::error_already_set();
  }
  const bool hooked = hook != Py_None;
  Py_DECREF(hook);
  // names made once (the GIL held): a call pays no string
  static PyObject* const handler = PyUnicode_InternFromString("handler");
  static PyObject* const thread = PyUnicode_InternFromString("thread");
  static PyObject* const lane_counter = PyUnicode_InternFromString("lane_counter");
  if (hooked || !attribute_is(drawing, handler, lane.handler) ||
      !attribute_is(drawing, thread, nullptr, PyThread_get_thread_ident()) || watched_frame_on_stack()) {
    return false;
  }
  const auto sizes = self.sizes();
  PyObject* size = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyTuple_SET_ITEM(size, i, PyLong_FromLongLong(sizes[i]));
  }
  PyObject* counter = PyObject_GetAttr(lane.counters, lane_counter);
  PyObject* got = counter != nullptr ? PyObject_CallOneArg(counter, size) : nullptr;
  Py_XDECREF(counter);
  Py_DECREF(size);
  if (got == nullptr) {
    throw pybind11::error_already_set();
  }
  const bool served = got != Py_None;
  if (served) {
    seed = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(got, 0));
    first = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(got, 1));
  }
  Py_DECREF(got);
  if (PyErr_Occurred()) {
    throw pybind11::error_already_set();
  }
  return served;
}

class RandomOpKernel final : public c10::OperatorKernel {
 public:
  RandomOpKernel(c10::SafeKernelFunction stock, c10::SafeKernelFunction stream, bool on_lane)
      : stock_(std::move(stock)), stream_(std::move(stream)), on_lane_(on_lane) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (!at::impl::ThreadLocalPythonObjects::contains(kHandlerKey)) {
      stock_.callBoxed(op, keys, stack);
      return;
    }
    bool drawing = false, reserved = false;
    uint64_t seed = 0, first = 0;
    {
      pybind11::gil_scoped_acquire gil;
      PyObject* here = drawing_here();
      if (here != nullptr) {
        drawing = true;
        try {
          reserved = on_lane_ && lane.counters != nullptr && reserve_on_lane(here, *stack, seed, first);
        } catch (...) {
          Py_DECREF(here);
          throw;
        }
        Py_DECREF(here);
      }
    }
    if (reserved) {
      fill_on_lane(stack, seed, first);
    } else {
      (drawing ? stream_ : stock_).callBoxed(op, keys, stack);
    }
  }

 private:
  // bernoulli_'s values into self (the GIL released), then self as the result
  static void fill_on_lane(torch::jit::Stack* stack, uint64_t seed, uint64_t first) {
    const auto n = stack->size();
    at::Tensor self = (*stack)[n - 3].toTensor();
    // ceil(p * 2**32), as compile_rng.stream.threshold32: the product is exact
    const auto threshold = static_cast<uint64_t>(std::ceil((*stack)[n - 2].toDouble() * 4294967296.0));
    if (self.numel() != 0 &&
        lane.fill(1, self.data_ptr<float>(), nullptr, nullptr, self.numel(), seed, first, 0.0f, 1.0f, 1.0f, threshold,
                  0.0f, at::get_num_threads()) != 0) {
      throw std::runtime_error("compile_rng CPU kernel failed");
    }
    torch::jit::drop(*stack, 3);
    stack->emplace_back(std::move(self));
  }

  c10::SafeKernelFunction stock_;
  c10::SafeKernelFunction stream_;
  bool on_lane_;
};

// A warning handler that drops torch's "Overriding a previously registered kernel": here
// that is the point, and the kernel calls the one it overrides.
class Quiet final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

std::vector<std::unique_ptr<torch::Library>> libraries;

// Wrap op `name`.`overload`'s kernel at each of `keys` (backend keys where torch has one);
// in a stream they call the op's kernel at `stream_key` (compile_rng's Python kernel), or
// take the lane (`on_lane`: bernoulli_.float's kernels).
void serve(const std::string& name, const std::string& overload, const std::vector<std::string>& keys,
           const std::string& stream_key, bool on_lane) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  auto stream = op.getComputedKernelForDispatchKey(c10::parseDispatchKey(stream_key));
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  const std::string qualified = name.substr(name.find("::") + 2) + (overload.empty() ? "" : "." + overload);
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  for (const auto& key : keys) {
    const auto k = c10::parseDispatchKey(key);
    library->impl(qualified.c_str(), torch::dispatch(k, torch::CppFunction::makeFromBoxedFunctor(
        std::make_unique<RandomOpKernel>(op.getComputedKernelForDispatchKey(k), stream, on_lane))));
  }
  libraries.push_back(std::move(library));
}

// Give the lane what it calls: the eager stream's handler, the counters' module, the
// function returning Dynamo's frame hook, the address of cr_fast_f32 and the watched codes.
void set_lane(pybind11::object handler, pybind11::object counters, pybind11::object dynamo_hook, uintptr_t fill,
              const std::vector<uintptr_t>& watched) {
  lane.watched = std::unordered_set<uintptr_t>(watched.begin(), watched.end());
  Py_XDECREF(lane.handler);
  Py_XDECREF(lane.counters);
  Py_XDECREF(lane.dynamo_hook);
  lane.handler = handler.release().ptr();
  lane.counters = counters.release().ptr();
  lane.dynamo_hook = dynamo_hook.release().ptr();
  lane.fill = reinterpret_cast<FastF32>(fill);
}

// Remove every kernel serve() registered, and the lane's references.
void clear() {
  libraries.clear();
  Py_CLEAR(lane.handler);
  Py_CLEAR(lane.counters);
  Py_CLEAR(lane.dynamo_hook);
  lane.fill = nullptr;
  lane.watched.clear();
}

}  // namespace

PYBIND11_MODULE(COMPILE_RNG_MODULE, m) {
  m.def("serve", &serve);
  m.def("set_lane", &set_lane);
  m.def("clear", &clear);
}
