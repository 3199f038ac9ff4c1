// compile_rng's kernels for torch's random ops, in C++ (built at first use by
// compile_rng/eager/native_kernels.py).
//
// Each random op has a kernel here at one dispatch key, kLiveKey (torch's `Fake`, which no
// tensor carries and torch registers nothing at), with a fallthrough for every other op.
// No dispatch reaches that key unless the thread's dispatch state includes it, and only a
// compile_rng stream includes it (include(), from compile_rng.eager.random_kernels), for
// the stream's length: outside streams every random op runs torch's own kernels exactly as
// stock torch, with nothing of compile_rng in between. The thread state - the included key
// with the stream's handler beside it - is what the autograd engine hands its device
// threads, so a backward's recomputation draws from the stream too.
//
// The key sits below autograd and ADInplaceOrView (autograd records torch's backward
// around compile_rng's values; in-place draws count versions), below the Python key (a
// dispatch mode or a tensor subclass sees the op first, and its inner ops come here) and
// above BackendSelect (a factory such as randperm is seen with its own arguments). Tensors
// of backends compile_rng does not serve (Meta: tracing) go on to torch's kernels at once:
// the op is redispatched below the key, to torch's kernels as they are registered now.
// torch 2.11 and 2.12 order `Fake` above the Python key, whose inner ops exclude every key
// above it: there the kernels sit at the backend keys instead, over torch's kernel there,
// and outside streams call it at once, with no Python and no GIL.
//
// In a stream the kernel calls compile_rng's Python kernel for the op (registered at
// kPythonKernelKey, which no dispatch reaches), which draws from the stream. The common
// fills have a lane here too: bernoulli_(p) (dropout's), uniform_ and normal_ (rand's,
// randn's) on a plain dense float32 CPU tensor, and random_(low, high) (randint's) on a
// plain dense integer one, in the eager stream take their counters from one Python call (compile_rng.eager.short_draws.lane_counter, on the Python kernel's own
// path) and are filled by compile_rng's CPU kernels with the GIL released, skipping the
// Python kernel's layers (~13 us a call on a Xeon core). Anything the lane does not serve
// takes the Python kernel as before.
//
// Private torch C++ API, checked on torch 2.11-2.15: at::impl::ThreadLocalPythonObjects
// (the thread state torch._C._stash_obj_in_tls writes),
// c10::OperatorHandle::getComputedKernelForDispatchKey (torch.library.get_kernel's),
// c10::impl::TorchDispatchModeTLS::stack_len (torch.utils._python_dispatch's mode stack),
// c10::impl::PyObjectSlot::load_pyobj (a tensor's Python object, if it has one), and the
// `Fake` dispatch key (torch 2.11-2.15 register no kernel or fallback there; 2.13+ put it
// below the Python key, 2.11 and 2.12 above it). Semi-public: torch::getTHPDtype (a
// ScalarType's torch.dtype, as torch's own bindings return it).

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// The key of compile_rng's handler in the thread state (compile_rng.eager.random_kernels).
const std::string kHandlerKey = "compile_rng_random_op_handler";

// The key the random ops' kernels here sit at, included in a thread's dispatch state only
// inside compile_rng's streams (see the header).
constexpr c10::DispatchKey kLiveKey = c10::DispatchKey::Fake;

// The thread's stream object (compile_rng.eager.random_kernels._Drawing) as a new
// reference, or nullptr; the GIL held, and the key checked with `contains` first. torch
// 2.11 and 2.12 cannot remove a key, so there the thread keeps one cell (an object with a
// `value` slot, compile_rng._torch.core_internals._Cell) whose value is None outside a stream.
PyObject* drawing_here() {
  const auto& held = at::impl::ThreadLocalPythonObjects::get(kHandlerKey);
  PyObject* object = held->ptr(&held->pyinterpreter());
  if (!PyObject_HasAttrString(object, "value")) {
    Py_INCREF(object);
    return object;
  }
  PyObject* value = PyObject_GetAttrString(object, "value");
  if (value == nullptr) {
    throw pybind11::error_already_set();
  }
  if (value == Py_None) {
    Py_DECREF(value);
    return nullptr;
  }
  return value;
}

// compile_rng's CPU kernels (compile_rng/stream/csrc/philox.c): cr_fast_f32, float32
// uniform (op 0) and bernoulli (op 1) of a contiguous stream, cr_normal_f32, and the word
// kernels (one word per element, any width: cr_integers, cr_bernoulli_bits,
// cr_unit_uniform_bits, cr_open_unit_bits), which take two numbers a and b
using FastF32 = int (*)(int, float*, uint8_t*, const float*, int64_t, uint64_t, uint64_t, float, float, float,
                        uint64_t, float, int);
using NormalF32 = int (*)(float*, int64_t, uint64_t, uint64_t, int, const int64_t*, const int64_t*, float, float, int);
// (out, width, numel, seed, base, a, b, threads)
using WordKernel = int (*)(void*, int, int64_t, uint64_t, uint64_t, uint64_t, uint64_t, int);
// Which C function a fill calls; the lane maps short_draws' codes onto it (set_lane reads
// them from the module), so no number is shared by hand.
enum class Kernel { kFast, kNormal, kExponential, kWords };

// What the lane calls, from set_lane (owned references; the module keeps them until clear_lane()).
struct Lane {
  PyObject* handler = nullptr;   // the eager stream's handler: only its draws take the lane
  // compile_rng.eager.short_draws, whose lane_counter is read per call, so that it can be
  // replaced (the tests switch the lane off so)
  PyObject* counters = nullptr;
  PyObject* dynamo_hook = nullptr;  // returns Dynamo's frame hook, None when off
  PyObject* tensor_type = nullptr;  // torch.Tensor: a subclass's tensor (a Parameter) is not served
  FastF32 fast = nullptr;
  NormalF32 normal = nullptr;
  int64_t normal_code = -1, exponential_code = -1;  // short_draws.NORMAL and EXPONENTIAL
  WordKernel open_unit = nullptr;  // the exponential's (0, 1]
  std::unordered_map<int64_t, WordKernel> words;  // short_draws.WORD_KERNELS' codes
  // the code objects whose frames change a draw (draw_counters.watched_codes): with one on
  // the stack the Python kernel serves it
  std::unordered_set<uintptr_t> watched;
};
Lane lane;

// A draw the lane serves: short_draws.lane_counter's (kernel, seed, first counter, x0, x1, x2,
// n), its counters reserved, and the C functions as they were then (read with the GIL
// held: clear_lane() may empty the lane while the fill runs without it).
struct Fill {
  int64_t kernel;  // short_draws' code: cr_fast_f32's op where `kind` is kFast
  uint64_t seed, first;
  double x0, x1, x2;
  uint64_t n;  // float32 bernoulli's threshold; a word kernel's a (its b: x1)
  Kernel kind;
  FastF32 fast;
  NormalF32 normal;
  WordKernel word;  // kWords: its kernel; kExponential: cr_open_unit_bits; else null
};

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

// A name made once, in a function-local static (the GIL held): a call pays no string.
PyObject* name(const char* text) {
  PyObject* made = PyUnicode_InternFromString(text);
  if (made == nullptr) {
    throw pybind11::error_already_set();
  }
  return made;
}

// The lane's Python objects as owned references, taken once per draw with the GIL held. A
// draw makes Python calls (Dynamo's hook, the counters; a garbage collection's finalizers
// at any allocation), and in one another thread may run uninstall() (clear_lane) or a
// stream's set_lane: the draw keeps using what it took, never a cleared pointer.
struct LaneObjects {
  pybind11::object handler = pybind11::reinterpret_borrow<pybind11::object>(lane.handler);
  pybind11::object counters = pybind11::reinterpret_borrow<pybind11::object>(lane.counters);
  pybind11::object dynamo_hook = pybind11::reinterpret_borrow<pybind11::object>(lane.dynamo_hook);
  pybind11::object tensor_type = pybind11::reinterpret_borrow<pybind11::object>(lane.tensor_type);
};

// Whether a draw here may take the lane, the GIL held: this thread's eager stream (its
// handler, not a guard's or another stream's), no dispatch mode, Dynamo's frame hook off (it
// would compile the Python frames the lane calls; the Python kernel turns it off).
bool lane_open(PyObject* drawing, const LaneObjects& objects) {
  static PyObject* const handler = name("handler");
  static PyObject* const thread = name("thread");
  if (!objects.counters || c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    return false;
  }
  PyObject* hook = PyObject_CallNoArgs(objects.dynamo_hook.ptr());
  if (hook == nullptr) {
    throw pybind11::error_already_set();
  }
  const bool hooked = hook != Py_None;
  Py_DECREF(hook);
  return !hooked && attribute_is(drawing, handler, objects.handler.ptr()) &&
         attribute_is(drawing, thread, nullptr, PyThread_get_thread_ident());
}

// Whether short_draws.<function>() says yes (a Python error is raised as the op's).
bool asked(const LaneObjects& objects, PyObject* function_name) {
  PyObject* answer = PyObject_CallMethodNoArgs(objects.counters.ptr(), function_name);
  if (answer == nullptr) {
    throw pybind11::error_already_set();
  }
  const bool yes = answer == Py_True;
  Py_DECREF(answer);
  return yes;
}

// The lane op `op` (short_draws.LANE_OPS[op]) called as (self, numbers..., generator), the
// GIL held: true with its draw in `fill`, counters reserved; false where the Python kernel
// serves it (nothing reserved). A Python error from the counters (a refused draw) is raised
// as the Python kernel raises it.
bool reserve_on_lane(PyObject* drawing, const LaneObjects& objects, int64_t op, size_t arity,
                     const torch::jit::Stack& stack, Fill& fill) {
  static PyObject* const lane_counter = name("lane_counter");
  const size_t first_argument = stack.size() - arity;
  const at::Tensor& self = stack[first_argument].toTensor();
  // a lane op's numbers are floats (a float tensor's fill) or ints (random_'s bounds, on
  // an integer tensor; its `to` may be None)
  const bool integers = stack[first_argument + 1].isInt();
  const at::ScalarType dtype = self.scalar_type();
  const bool float_dtype =
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  if (!stack.back().isNone() || self.device().type() != c10::kCPU ||
      !(integers ? at::isIntegralType(dtype, /*includeBool=*/false) : float_dtype) ||
      self.layout() != c10::kStrided || !self.is_contiguous() || self.key_set().has(c10::DispatchKey::Python)) {
    return false;
  }
  for (size_t i = first_argument + 1; i + 1 < stack.size(); ++i) {
    if (integers ? !stack[i].isInt() : !stack[i].isDouble()) {
      return false;
    }
  }
  // a tensor with a Python object of a subclass (a Parameter) takes the Python kernel, as
  // the short path leaves it; one with none yet (made in C++: dropout's empty_like) is plain
  PyObject* object = self.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
  if ((object != nullptr && Py_TYPE(object) != reinterpret_cast<PyTypeObject*>(objects.tensor_type.ptr())) ||
      !lane_open(drawing, objects) || watched_frame_on_stack()) {
    return false;
  }
  // lane_counter(op, size, numbers...), and the dtype after the numbers unless it is
  // float32 (the common fill pays nothing for it)
  const bool with_dtype = dtype != at::kFloat;
  const auto sizes = self.sizes();
  PyObject* arguments = PyTuple_New(static_cast<Py_ssize_t>(with_dtype ? arity + 1 : arity));
  PyObject* size = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyTuple_SET_ITEM(size, i, PyLong_FromLongLong(sizes[i]));
  }
  PyTuple_SET_ITEM(arguments, 0, PyLong_FromLongLong(op));
  PyTuple_SET_ITEM(arguments, 1, size);
  for (size_t i = 2; i < arity; ++i) {
    const c10::IValue& number = stack[first_argument + i - 1];
    PyTuple_SET_ITEM(arguments, i, integers ? PyLong_FromLongLong(number.toInt()) : PyFloat_FromDouble(number.toDouble()));
  }
  if (with_dtype) {
    PyObject* dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype));
    Py_INCREF(dtype_object);
    PyTuple_SET_ITEM(arguments, arity, dtype_object);
  }
  PyObject* counter = PyObject_GetAttr(objects.counters.ptr(), lane_counter);
  PyObject* got = counter != nullptr ? PyObject_Call(counter, arguments, nullptr) : nullptr;
  Py_XDECREF(counter);
  Py_DECREF(arguments);
  if (got == nullptr) {
    throw pybind11::error_already_set();
  }
  const bool served = got != Py_None;
  if (served) {
    const int64_t code = PyLong_AsLongLong(PyTuple_GET_ITEM(got, 0));
    const auto word = lane.words.find(code);
    const Kernel kind = code == lane.normal_code        ? Kernel::kNormal
                        : code == lane.exponential_code ? Kernel::kExponential
                        : word != lane.words.end()      ? Kernel::kWords
                                                        : Kernel::kFast;
    fill = Fill{code, PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(got, 1)),
                PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(got, 2)), PyFloat_AsDouble(PyTuple_GET_ITEM(got, 3)),
                PyFloat_AsDouble(PyTuple_GET_ITEM(got, 4)), PyFloat_AsDouble(PyTuple_GET_ITEM(got, 5)),
                PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(got, 6)), kind, lane.fast, lane.normal,
                kind == Kernel::kWords         ? word->second
                : kind == Kernel::kExponential ? lane.open_unit
                                               : nullptr};
  }
  Py_DECREF(got);
  if (PyErr_Occurred()) {
    throw pybind11::error_already_set();
  }
  return served;
}

// short_draws' index of an op that takes the lane through torch's own kernel
// (LANE_FACTORIES: rand, randn and their *_like fill an empty tensor with a lane op)
constexpr int64_t kThroughTorch = -2;

class RandomOpKernel final : public c10::OperatorKernel {
 public:
  // stream: the op's Python kernel; lane_op: the op's index in short_draws.LANE_OPS,
  // kThroughTorch, or -1. At kLiveKey: served, the backend keys compile_rng draws on, and
  // options, where the op's dtype, layout and device arguments are (a factory's, else -1).
  // At a backend key: stock, torch's kernel there.
  RandomOpKernel(c10::SafeKernelFunction stream, int64_t lane_op, std::vector<c10::DispatchKey> served,
                 std::array<int, 3> options, std::optional<c10::SafeKernelFunction> stock = std::nullopt)
      : stream_(std::move(stream)), lane_op_(lane_op), served_(std::move(served)), options_(options),
        stock_(std::move(stock)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    // at a backend key every call comes here, in a stream or not: outside one, torch's
    // kernel at once, with no GIL (the key is in the thread state only in a stream)
    const c10::DispatchKeySet below =
        stock_ ? keys : keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kLiveKey);
    if (stock_ ? !at::impl::ThreadLocalPythonObjects::contains(kHandlerKey) : !served(op, below, *stack)) {
      call_below(op, below, stack);
      return;
    }
    const size_t arity = op.schema().arguments().size();
    bool drawing = false, reserved = false, through_torch = false;
    Fill fill{};
    {
      pybind11::gil_scoped_acquire gil;
      PyObject* here = at::impl::ThreadLocalPythonObjects::contains(kHandlerKey) ? drawing_here() : nullptr;
      if (here != nullptr) {
        drawing = true;
        const LaneObjects objects;
        try {
          if (lane_op_ >= 0) {
            reserved = reserve_on_lane(here, objects, lane_op_, arity, *stack, fill);
          } else if (lane_op_ == kThroughTorch) {
            static PyObject* const lane_through_torch = name("lane_through_torch");
            through_torch = lane_open(here, objects) && asked(objects, lane_through_torch);
          }
        } catch (...) {
          Py_DECREF(here);
          throw;
        }
        Py_DECREF(here);
      }
    }
    if (reserved) {
      fill_on_lane(stack, arity, fill);
    } else if (through_torch) {
      run_through_torch(op, below, stack);
    } else if (drawing) {
      stream_.callBoxed(op, below, stack);
    } else {
      call_below(op, below, stack);
    }
  }

 private:
  // torch's kernels for the op below this one: the one read at registration at a backend
  // key, else a redispatch (torch's kernels as registered now)
  void call_below(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) const {
    if (stock_) {
      stock_->callBoxed(op, below, stack);
    } else {
      op.redispatchBoxed(below, stack);
    }
  }

  // Whether the call is on a backend compile_rng serves, where torch has a kernel of the
  // op (else torch's kernels run it, as with no stream): the backend of the tensors, or for
  // a factory (BackendSelect's turn) the one its arguments name, as BackendSelect reads it.
  bool served(const c10::OperatorHandle& op, c10::DispatchKeySet below, const torch::jit::Stack& stack) const {
    // PythonDispatcher: every keyset below a key keeps it (torch's Python dispatcher, when on,
    // sees each redispatch); it names no backend
    c10::DispatchKey key = below.remove(c10::DispatchKey::PythonDispatcher).highestPriorityTypeId();
    if (key == c10::DispatchKey::BackendSelect) {
      const size_t first = stack.size() - op.schema().arguments().size();
      const auto option = [&](int index) -> const c10::IValue* {
        return index < 0 || stack[first + index].isNone() ? nullptr : &stack[first + index];
      };
      const c10::IValue *dtype = option(options_[0]), *layout = option(options_[1]), *device = option(options_[2]);
      key = c10::computeDispatchKey(dtype ? std::optional<c10::ScalarType>(dtype->toScalarType()) : std::nullopt,
                                    layout ? std::optional<c10::Layout>(layout->toLayout()) : std::nullopt,
                                    device ? std::optional<c10::Device>(device->toDevice()) : std::nullopt);
    }
    return std::find(served_.begin(), served_.end(), key) != served_.end() && op.hasComputedKernelForDispatchKey(key);
  }

  // torch's kernel of a LANE_FACTORIES op, whose fill draws from the stream. compile_rng's
  // refusals (NotImplementedError: the rows, the batch dim, a replay) come before anything is
  // reserved: the op's own Python kernel then raises it again, naming the op the user called
  // (rand, not the uniform_ inside it). Any other error stands as it is (it may come after a
  // reservation, which a second run would repeat), and so does the first error should the
  // op's kernel not raise: the two paths would disagree.
  void run_through_torch(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
    const torch::jit::Stack arguments = *stack;
    try {
      call_below(op, below, stack);
    } catch (pybind11::error_already_set& error) {
      bool refused = false;
      {
        pybind11::gil_scoped_acquire gil;
        refused = error.matches(PyExc_NotImplementedError);
      }
      if (!refused) {
        throw;
      }
      *stack = arguments;
      stream_.callBoxed(op, below, stack);
      throw;
    }
  }

  // The tensor a fill computes in: self where it has the compute dtype, else a fresh one
  // (see rounded_into).
  static at::Tensor computed_in(const at::Tensor& self, at::ScalarType compute) {
    return self.scalar_type() == compute ? self : at::empty(self.sizes(), self.options().dtype(compute));
  }

  // computed_in's values into self, rounded by torch's own copy where they are another
  // tensor, as the general path's .to(dtype) rounds them.
  static void rounded_into(at::Tensor& self, const at::Tensor& values) {
    if (!values.is_same(self)) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // the op on self is recorded already
      self.copy_(values);
    }
  }

  // the draw's values into self (the GIL released), then self as the result
  static void fill_on_lane(torch::jit::Stack* stack, size_t arity, const Fill& fill) {
    at::Tensor self = (*stack)[stack->size() - arity].toTensor();
    const int64_t numel = self.numel(), one = 1;
    if (numel != 0) {
      const int threads = at::get_num_threads();
      int failed = 0;
      if (fill.kind == Kernel::kWords) {
        failed = fill.word(self.data_ptr(), static_cast<int>(self.element_size()), numel, fill.seed, fill.first,
                           fill.n, static_cast<uint64_t>(fill.x1), threads);
      } else if (fill.kind == Kernel::kNormal) {
        at::Tensor values = computed_in(self, at::kFloat);
        failed = fill.normal(values.data_ptr<float>(), numel, fill.seed, fill.first, 1, &numel, &one,
                             static_cast<float>(fill.x0), static_cast<float>(fill.x1), threads);
        if (failed == 0) {
          rounded_into(self, values);
        }
      } else if (fill.kind == Kernel::kExponential) {
        // log(u) * x0 (x0 = -1 / lambd) by torch's own log and mul, as the general path
        // computes it, in its compute dtype (float64 for float64, else float32)
        at::Tensor values = computed_in(self, self.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
        failed = fill.word(values.data_ptr(), static_cast<int>(values.element_size()), numel, fill.seed, fill.first,
                           0, 0, threads);
        if (failed == 0) {
          at::AutoDispatchBelowADInplaceOrView below_autograd;  // the op on self is recorded already
          values.log_().mul_(fill.x0);
          rounded_into(self, values);
        }
      } else {
        failed = fill.fast(static_cast<int>(fill.kernel), self.data_ptr<float>(), nullptr, nullptr, numel, fill.seed,
                           fill.first, static_cast<float>(fill.x0), static_cast<float>(fill.x1),
                           static_cast<float>(fill.x2), fill.n, 0.0f, threads);
      }
      if (failed != 0) {
        throw std::runtime_error("compile_rng CPU kernel failed");
      }
    }
    torch::jit::drop(*stack, arity);
    stack->emplace_back(std::move(self));
  }

  c10::SafeKernelFunction stream_;
  int64_t lane_op_;
  std::vector<c10::DispatchKey> served_;
  std::array<int, 3> options_;
  std::optional<c10::SafeKernelFunction> stock_;
};

// A warning handler that drops torch's "Overriding a previously registered kernel" (at a
// backend key): here that is the point, and the kernel calls the one it overrides.
class Quiet final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

std::vector<std::unique_ptr<torch::Library>> libraries;

// A fallthrough at kLiveKey for every op, registered once for the process and kept: a
// thread that includes the key runs every op compile_rng has no kernel for as if the key
// were not there (torch would raise on a key with no kernel). No dispatch reaches it
// otherwise; registering a fallback costs ~1 ms, which a step after uninstall() would pay.
void fall_through_once() {
  static const bool registered = [] {
    static torch::Library library(torch::Library::IMPL, "_", kLiveKey, __FILE__, __LINE__);
    library.fallback(torch::CppFunction::makeFallthrough());
    return true;
  }();
  (void)registered;
}

// Where each of an op's arguments dtype, layout and device is (-1: none).
std::array<int, 3> option_arguments(const c10::OperatorHandle& op) {
  std::array<int, 3> options{-1, -1, -1};
  const auto& arguments = op.schema().arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const std::string& argument = arguments[i].name();
    const int at = argument == "dtype" ? 0 : argument == "layout" ? 1 : argument == "device" ? 2 : -1;
    if (at >= 0) {
      options[at] = static_cast<int>(i);
    }
  }
  return options;
}

// Serve each op of `ops` - (name, overload, lane_op, keys) - calling, in a stream, the op's
// kernel at `stream_key` (compile_rng's Python kernel), or taking the lane (`lane_op`: the
// op's index in short_draws.LANE_OPS, -2 for the LANE_FACTORIES, -1 for none). With no
// `keys`, at kLiveKey, drawing on the backend keys `backends`; else at each of `keys` (torch
// 2.11 and 2.12, whose Python key sits below kLiveKey: a dispatch mode's or a subclass's
// inner ops would pass it by), over torch's kernel there, read now.
void serve(const std::vector<std::tuple<std::string, std::string, int64_t, std::vector<std::string>>>& ops,
           const std::string& stream_key, const std::vector<std::string>& backends) {
  std::vector<c10::DispatchKey> served;
  for (const auto& backend : backends) {
    served.push_back(c10::parseDispatchKey(backend));
  }
  const c10::DispatchKey python_kernel_key = c10::parseDispatchKey(stream_key);
  if (std::any_of(ops.begin(), ops.end(), [](const auto& op) { return std::get<3>(op).empty(); })) {
    fall_through_once();  // first: where another fallback holds the key, this raises before any registration
  }
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  for (const auto& [name, overload, lane_op, keys] : ops) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto stream = op.getComputedKernelForDispatchKey(python_kernel_key);
    const std::string qualified = name.substr(name.find("::") + 2) + (overload.empty() ? "" : "." + overload);
    if (keys.empty()) {
      library->impl(qualified.c_str(), torch::dispatch(kLiveKey, torch::CppFunction::makeFromBoxedFunctor(
          std::make_unique<RandomOpKernel>(stream, lane_op, served, option_arguments(op)))));
    }
    for (const auto& key : keys) {
      const auto k = c10::parseDispatchKey(key);
      library->impl(qualified.c_str(), torch::dispatch(k, torch::CppFunction::makeFromBoxedFunctor(
          std::make_unique<RandomOpKernel>(stream, lane_op, std::vector<c10::DispatchKey>{}, std::array<int, 3>{-1, -1, -1},
                                           op.getComputedKernelForDispatchKey(k)))));
    }
  }
  libraries.push_back(std::move(library));
}

// Include kLiveKey in this thread's dispatch state (a stream opens) or take it out; the
// previous setting is returned.
bool include(bool on) {
  const bool was = c10::impl::tls_is_dispatch_key_included(kLiveKey);
  c10::impl::tls_set_dispatch_key_included(kLiveKey, on);
  return was;
}

// Give the lane what it calls: the eager stream's handler, the counters' module
// (short_draws: its lane_counter, the codes NORMAL and EXPONENTIAL and the word kernels'
// codes and C names WORD_KERNELS its fills name), the function returning Dynamo's frame hook, torch.Tensor,
// the addresses of compile_rng's C functions by name (cpu_kernel.kernel_addresses), and the
// watched codes.
void set_lane(pybind11::object handler, pybind11::object counters, pybind11::object dynamo_hook,
              pybind11::object tensor_type, const std::unordered_map<std::string, uintptr_t>& addresses,
              const std::vector<uintptr_t>& watched) {
  // read everything that can fail before the lane changes
  const int64_t normal_code = counters.attr("NORMAL").cast<int64_t>();
  const int64_t exponential_code = counters.attr("EXPONENTIAL").cast<int64_t>();
  const auto open_unit = reinterpret_cast<WordKernel>(addresses.at("cr_open_unit_bits"));
  std::unordered_map<int64_t, WordKernel> words;
  for (const auto& [code, name] : counters.attr("WORD_KERNELS").cast<std::unordered_map<int64_t, std::string>>()) {
    words[code] = reinterpret_cast<WordKernel>(addresses.at(name));
  }
  const auto fast = reinterpret_cast<FastF32>(addresses.at("cr_fast_f32"));
  const auto normal = reinterpret_cast<NormalF32>(addresses.at("cr_normal_f32"));
  lane.watched = std::unordered_set<uintptr_t>(watched.begin(), watched.end());
  Py_XDECREF(lane.handler);
  Py_XDECREF(lane.counters);
  Py_XDECREF(lane.dynamo_hook);
  Py_XDECREF(lane.tensor_type);
  lane.handler = handler.release().ptr();
  lane.counters = counters.release().ptr();
  lane.dynamo_hook = dynamo_hook.release().ptr();
  lane.tensor_type = tensor_type.release().ptr();
  lane.fast = fast;
  lane.normal = normal;
  lane.normal_code = normal_code;
  lane.exponential_code = exponential_code;
  lane.open_unit = open_unit;
  lane.words = std::move(words);
}

// Drop the lane's Python references (uninstall()): the lane is closed (a draw's LaneObjects
// hold no counters) until a stream sets it again. A layout block open across uninstall() keeps
// the key; its draws then take the Python kernel. The C functions and codes stay: a draw
// that reserved its counters just before another thread cleared the lane still fills with
// them (compile_rng's C library stays loaded for the process).
void clear_lane() {
  Py_CLEAR(lane.handler);
  Py_CLEAR(lane.counters);
  Py_CLEAR(lane.dynamo_hook);
  Py_CLEAR(lane.tensor_type);
}

// Remove every kernel serve() registered, and the lane's references.
void clear() {
  libraries.clear();
  clear_lane();
}

}  // namespace

PYBIND11_MODULE(COMPILE_RNG_MODULE, m) {
  m.def("serve", &serve);
  m.def("include", &include);
  m.attr("LIVE_KEY") = static_cast<int>(kLiveKey);  // the key's number (torch's Python enum has no name for it)
  m.def("set_lane", &set_lane);
  m.def("clear_lane", &clear_lane);
  m.def("clear", &clear);
}
