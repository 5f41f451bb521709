// csa_ops native launch path: a prepared kernel call (one validated call signature) whose
// per-call work runs in C++ with torch's own allocator and current stream.
//
// Why: in Python each output allocation costs 2-6 us and each launch a few more, which puts
// the ops' eager calls at several times a torch.add. Here the outputs come from at::empty
// (torch's caching allocator, so CUDA-graph trees and record_stream work as for any torch
// tensor) and the compiled kernel, a TVM-FFI function, is called through the TVM-FFI C API.
//
// Nothing here knows the kernels' argument list: Python hands over a program per launch, one
// slot per kernel argument (an input's, output's or the workspace's address, or a
// constant), built from a call's csa_ops.launch_description.CallSpec, which derives from
// ARGUMENTS, the one statement of that list. The stream follows the slots.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/TensorFactories.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <tvm/ffi/c_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

enum Source : int64_t { kInput = 0, kOutput = 1, kWorkspace = 2, kConstant = 3 };

constexpr size_t kMaxSlots = 24;  // the longest argument list (extend) has 15

// An output: the dtype and device of input `like`; the shape given, or the input's.
struct OutputSpec {
  int64_t like;
  std::vector<int64_t> shape;
  bool own_shape;
};

[[noreturn]] void raise_ffi_error() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  std::string message = "csa_ops: the kernel call failed";
  if (error != nullptr) {
    const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
    message = std::string(cell->kind.data, cell->kind.size) + ": " +
              std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(error);
  }
  throw std::runtime_error(message);
}

int64_t current_stream(const c10::Device& device) {
  if (!device.is_cuda()) {
    return 0;  // host tensors (tests of the call itself): no stream
  }
  static const c10::impl::DeviceGuardImplInterface* cuda =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return reinterpret_cast<int64_t>(cuda->getStream(device).native_handle());
}

// A contiguous tensor from the device's allocator (torch's caching allocator on CUDA), as
// at::empty makes it but without its trip through the dispatcher: a quarter of a call's
// host time goes to four allocations. Under torch.use_deterministic_algorithms it is filled
// as at::empty fills it (the kernels overwrite every element anyway). The caller holds a
// guard of `device`.
at::Tensor allocate(c10::IntArrayRef shape, at::ScalarType dtype, const c10::Device& device) {
  at::Tensor tensor = at::detail::empty_generic(
      shape, c10::GetAllocator(device.type()),
      c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, device)), dtype,
      c10::MemoryFormat::Contiguous);
  const auto& context = at::globalContext();
  if (C10_UNLIKELY(context.deterministicAlgorithms() &&
                   context.deterministicFillUninitializedMemory())) {
    at::native::fill_empty_deterministic_(tensor);
  }
  return tensor;
}

using Slots = std::vector<std::pair<int64_t, int64_t>>;

class PreparedCall {
 public:
  // launches: (function, slots) per kernel launch, in order. function: a TVM-FFI function
  //   handle (held for this object's life); slots: (source, value) per kernel argument:
  //   input/output index, 0 for the workspace, or the constant itself.
  // align: per input, the byte alignment the kernel assumes (0: none); a misaligned input
  //   (a view starting mid-allocation) is copied first, except an input in `in_place`
  //   (written by the kernels): then the call does nothing and returns None.
  // to_float: inputs the kernel reads as fp32 (ape in any float dtype).
  // outputs: (like, shape or None) per output.
  // restore: (output, input) pairs: the output is cast back to the input's dtype as passed.
  // workspace: fp32 elements of scratch, 0 for none.
  // live: an input whose address stands in for a zero one (an empty tensor), -1 for none.
  PreparedCall(std::vector<std::pair<int64_t, Slots>> launches, std::vector<int64_t> align,
               std::vector<int64_t> in_place, std::vector<int64_t> to_float,
               std::vector<std::pair<int64_t, std::optional<std::vector<int64_t>>>> outputs,
               std::vector<std::pair<int64_t, int64_t>> restore, int64_t workspace,
               int64_t live)
      : align_(std::move(align)),
        in_place_(align_.size(), false),
        to_float_(std::move(to_float)),
        restore_(std::move(restore)),
        workspace_(workspace),
        live_(live) {
    TORCH_CHECK(!launches.empty(), "PreparedCall: no launch");
    const auto inputs = static_cast<int64_t>(align_.size());
    for (int64_t i : in_place) {
      TORCH_CHECK(0 <= i && i < inputs, "PreparedCall: in_place input ", i, " of ", inputs);
      in_place_[i] = true;
    }
    TORCH_CHECK(-1 <= live_ && live_ < inputs, "PreparedCall: live input ", live_, " of ",
                inputs);
    for (const auto& [like, shape] : outputs) {
      TORCH_CHECK(0 <= like && like < inputs, "PreparedCall: output like input ", like,
                  " of ", inputs);
      outputs_.push_back({like, shape.value_or(std::vector<int64_t>{}), shape.has_value()});
    }
    const auto num_outputs = static_cast<int64_t>(outputs_.size());
    for (auto& [function, slots] : launches) {
      TORCH_CHECK(function != 0, "PreparedCall: function is a null handle");
      TORCH_CHECK(slots.size() + 1 <= kMaxSlots, "PreparedCall: ", slots.size(),
                  " slots, at most ", kMaxSlots - 1);
      for (const auto& [source, value] : slots) {
        const bool ok = (source == kInput && 0 <= value && value < inputs) ||
                        (source == kOutput && 0 <= value && value < num_outputs) ||
                        (source == kWorkspace && workspace_ > 0) || source == kConstant;
        TORCH_CHECK(ok, "PreparedCall: bad slot (", source, ", ", value, ")");
      }
      launches_.push_back({reinterpret_cast<TVMFFIObjectHandle>(function), std::move(slots)});
    }
    for (int64_t i : to_float_) {
      TORCH_CHECK(0 <= i && i < inputs, "PreparedCall: to_float input ", i, " of ", inputs);
    }
    for (const auto& [out, in] : restore_) {
      TORCH_CHECK(0 <= out && out < num_outputs && 0 <= in && in < inputs,
                  "PreparedCall: bad restore pair (", out, ", ", in, ")");
    }
    for (const auto& launch : launches_) {
      TVMFFIObjectIncRef(launch.function);
    }
  }

  ~PreparedCall() {
    for (const auto& launch : launches_) {
      TVMFFIObjectDecRef(launch.function);
    }
  }
  PreparedCall(const PreparedCall&) = delete;
  PreparedCall& operator=(const PreparedCall&) = delete;

  size_t num_inputs() const { return align_.size(); }

  // The call on the op's tensors in schema order; returns its outputs, or nothing where an
  // in-place input breaks its alignment (nothing was launched).
  std::optional<c10::SmallVector<at::Tensor, 4>> run(c10::ArrayRef<at::Tensor> tensors) const {
    const size_t n = align_.size();
    TORCH_CHECK(tensors.size() == n, "csa_ops native call: expected ", n, " tensors, got ",
                tensors.size());
    c10::SmallVector<at::Tensor, 8> in;
    c10::SmallVector<at::ScalarType, 8> passed;
    for (const at::Tensor& tensor : tensors) {
      passed.push_back(tensor.scalar_type());
      in.push_back(tensor.contiguous());
    }
    for (int64_t i : to_float_) {
      in[i] = in[i].to(at::kFloat);
    }
    for (size_t i = 0; i < n; ++i) {
      if (align_[i] != 0 && reinterpret_cast<uintptr_t>(in[i].data_ptr()) % align_[i] != 0) {
        if (in_place_[i]) {
          return std::nullopt;  // written in place: a copy would not be written back
        }
        in[i] = in[i].clone();  // a fresh allocation is aligned
      }
    }
    const c10::Device device = in[0].device();
    c10::DeviceGuard guard(device);
    c10::SmallVector<at::Tensor, 4> out;
    for (const OutputSpec& spec : outputs_) {
      const at::Tensor& like = in[spec.like];
      out.push_back(allocate(spec.own_shape ? c10::IntArrayRef(spec.shape) : like.sizes(),
                             like.scalar_type(), device));
    }
    at::Tensor workspace;
    if (workspace_ > 0) {
      workspace = allocate({workspace_}, at::kFloat, device);
    }

    const int64_t stream = current_stream(device);
    const int64_t live = live_ >= 0 ? reinterpret_cast<int64_t>(in[live_].data_ptr()) : 0;
    for (const auto& launch : launches_) {
      TVMFFIAny argv[kMaxSlots];
      size_t k = 0;
      for (const auto& [source, value] : launch.slots) {
        int64_t v = value;
        if (source == kInput) {
          v = reinterpret_cast<int64_t>(in[value].data_ptr());
        } else if (source == kOutput) {
          v = reinterpret_cast<int64_t>(out[value].data_ptr());
        } else if (source == kWorkspace) {
          v = reinterpret_cast<int64_t>(workspace.data_ptr());
        }
        if (v == 0 && source != kConstant) {
          v = live;
        }
        set_int(argv[k++], v);
      }
      set_int(argv[k++], stream);
      TVMFFIAny result;
      result.type_index = kTVMFFINone;
      result.zero_padding = 0;
      result.v_int64 = 0;
      if (TVMFFIFunctionCall(launch.function, argv, static_cast<int32_t>(k), &result) != 0) {
        raise_ffi_error();
      }
      if (result.type_index >= kTVMFFIStaticObjectBegin) {
        TVMFFIObjectDecRef(result.v_obj);
      }
    }
    for (const auto& [o, i] : restore_) {
      out[o] = out[o].to(passed[i]);
    }
    return out;
  }

  // The Python call: the op's tensors; the output, or a tuple of them.
  py::object operator()(const py::args& args) const {
    c10::SmallVector<at::Tensor, 8> tensors;
    for (size_t i = 0; i < args.size(); ++i) {
      PyObject* obj = args[i].ptr();
      TORCH_CHECK(THPVariable_Check(obj), "csa_ops native call: argument ", i,
                  " is not a tensor");
      tensors.push_back(THPVariable_Unpack(obj));
    }
    auto out = run(tensors);
    if (!out) {
      return py::none();
    }
    return to_python(std::move(*out));
  }

  static py::object to_python(c10::SmallVector<at::Tensor, 4>&& out) {
    if (out.size() == 1) {
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[0])));
    }
    py::tuple result(out.size());
    for (size_t j = 0; j < out.size(); ++j) {
      result[j] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[j])));
    }
    return result;
  }

 private:
  static void set_int(TVMFFIAny& any, int64_t value) {
    any.type_index = kTVMFFIInt;
    any.zero_padding = 0;
    any.v_int64 = value;
  }

  struct Launch {
    TVMFFIObjectHandle function;
    Slots slots;
  };

  std::vector<Launch> launches_;
  std::vector<int64_t> align_;
  std::vector<bool> in_place_;
  std::vector<int64_t> to_float_;
  std::vector<OutputSpec> outputs_;
  std::vector<std::pair<int64_t, int64_t>> restore_;
  int64_t workspace_;
  int64_t live_;
};

// Metadata signature -> prepared call, looked up and called in one step: what
// csa_ops.dispatch's memo does in Python, where building the signature alone costs more than
// a quarter of a call. A signature is the bytes of each argument's metadata: a tensor's
// shape, dtype and device, an int's value, None; the same bytes from Python objects and
// from the dispatcher's IValues. A call whose signature is absent (or holds anything else)
// returns None and takes the Python route, which validates and prepares it.
class CallTable {
 public:
  struct Entry {
    std::shared_ptr<PreparedCall> call;
    size_t tensors;  // the call takes the leading arguments; the rest are its scalars
  };

  void insert(std::shared_ptr<PreparedCall> call, size_t tensors, const py::args& args) {
    std::string key;
    TORCH_CHECK(python_signature(args, key), "CallTable.insert: unsupported argument");
    TORCH_CHECK(tensors == call->num_inputs() && tensors <= args.size(),
                "CallTable.insert: the call takes ", call->num_inputs(), " tensors");
    std::unique_lock lock(mutex_);
    entries_[key] = Entry{std::move(call), tensors};
  }

  py::object operator()(const py::args& args) const {
    std::string key;
    Entry entry;
    if (!python_signature(args, key) || !find(key, entry)) {
      return py::none();
    }
    return (*entry.call)(py::args(args[py::slice(0, entry.tensors, 1)]));
  }

  // Copies the entry out: a call in flight keeps its prepared call alive whatever happens
  // to the table meanwhile (the C++ kernels read it without holding the GIL).
  bool find(const std::string& key, Entry& entry) const {
    std::shared_lock lock(mutex_);
    const auto found = entries_.find(key);
    if (found == entries_.end()) {
      return false;
    }
    entry = found->second;
    return true;
  }

  static bool ivalue_signature(c10::ArrayRef<c10::IValue> args, std::string& key) {
    key.reserve(args.size() * 40);
    for (const c10::IValue& arg : args) {
      if (arg.isTensor()) {
        put_tensor(key, arg.toTensor());
      } else if (arg.isNone()) {
        put(key, 'N');
      } else if (arg.isInt()) {
        put(key, 'I');
        put(key, arg.toInt());
      } else {
        return false;  // symbolic sizes and anything else: the Python route decides
      }
    }
    return true;
  }

  void clear() {
    std::unique_lock lock(mutex_);
    entries_.clear();
  }
  size_t size() const {
    std::shared_lock lock(mutex_);
    return entries_.size();
  }

 private:
  static void put(std::string& key, int64_t value) {
    key.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }

  static void put_tensor(std::string& key, const at::Tensor& tensor) {
    put(key, 'T');
    put(key, tensor.dim());
    for (int64_t size : tensor.sizes()) {
      put(key, size);
    }
    put(key, static_cast<int64_t>(tensor.scalar_type()));
    put(key, static_cast<int64_t>(tensor.device().type()));
    put(key, tensor.device().index());
  }

  static bool python_signature(const py::args& args, std::string& key) {
    key.reserve(args.size() * 40);
    for (const py::handle& arg : args) {
      PyObject* obj = arg.ptr();
      if (THPVariable_Check(obj)) {
        put_tensor(key, THPVariable_Unpack(obj));
      } else if (obj == Py_None) {
        put(key, 'N');
      } else if (PyLong_CheckExact(obj)) {
        int overflow = 0;
        const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow != 0) {
          return false;
        }
        put(key, 'I');
        put(key, value);
      } else {
        return false;  // bools, SymInts, anything else: the Python route decides
      }
    }
    return true;
  }

  mutable std::shared_mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;
};

// An op's kernel at an Autograd key (AutogradCUDA): a call on plain tensors of the backend
// that wants no gradient and whose signature is in the table runs its prepared call here,
// with no Python at all; every other call goes to the op's Python Autograd kernel
// (csa_ops.ops), which records autograd, validates, prepares and enters new signatures in
// the table. Registered at the backend's own Autograd key, it takes precedence over the
// Python kernel at the Autograd alias key, which stays registered for every other backend.
//
// Nothing it holds is released with it: torch's dispatcher is a static object whose
// destruction at exit frees registered kernels, after Python and the TVM-FFI runtime are
// gone, so the table (and the prepared calls and kernel handles in it) and the Python
// kernel are references held for the process's life.
class AutogradKernel final : public c10::OperatorKernel {
 public:
  AutogradKernel(const CallTable* table, PyObject* python_kernel, c10::DispatchKeySet backend)
      : table_(table), python_kernel_(python_kernel), backend_(backend) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    const auto args = torch::jit::last(*stack, n);
    std::string key;
    CallTable::Entry entry;
    if (!plain(keys, args) || !CallTable::ivalue_signature(args, key) ||
        !table_->find(key, entry)) {
      call_python(keys, stack, n);
      return;
    }
    c10::SmallVector<at::Tensor, 8> tensors;
    for (size_t i = 0; i < entry.tensors; ++i) {
      tensors.push_back(args[i].toTensor());
    }
    c10::SmallVector<at::Tensor, 4> out;
    {
      at::AutoDispatchBelowADInplaceOrView below;  // its own ops record no autograd either
      auto result = entry.call->run(tensors);
      // Only calls without in-place inputs enter the table: none returns nothing.
      TORCH_CHECK(result.has_value(), "csa_ops native: a table call launched nothing");
      out = std::move(*result);
    }
    return_outputs(stack, n, out);
  }

 private:
  // Only the backend's dense tensors below autograd, and no gradient to record.
  bool plain(c10::DispatchKeySet keys, c10::ArrayRef<c10::IValue> args) const {
    const auto below = (keys & c10::after_autograd_keyset).remove(c10::DispatchKey::ADInplaceOrView);
    if (below != backend_) {
      return false;
    }
    if (at::GradMode::is_enabled()) {
      for (const c10::IValue& arg : args) {
        if (arg.isTensor() && arg.toTensor().requires_grad()) {
          return false;
        }
      }
    }
    return true;
  }

  void call_python(c10::DispatchKeySet keys, torch::jit::Stack* stack, size_t n) const {
    py::gil_scoped_acquire gil;
    py::tuple args(n + 1);
    args[0] = py::cast(keys);
    const auto values = torch::jit::last(*stack, n);
    for (size_t i = 0; i < n; ++i) {
      args[i + 1] = torch::jit::toPyObject(values[i]);
    }
    py::object result = py::reinterpret_borrow<py::object>(python_kernel_)(*args);
    c10::SmallVector<at::Tensor, 4> out;
    if (THPVariable_Check(result.ptr())) {
      out.push_back(THPVariable_Unpack(result.ptr()));
    } else {
      for (const py::handle& item : result) {
        TORCH_CHECK(THPVariable_Check(item.ptr()),
                    "csa_ops native: the Python Autograd kernel returned a non-tensor");
        out.push_back(THPVariable_Unpack(item.ptr()));
      }
    }
    return_outputs(stack, n, out);
  }

  // The boxed convention: the n arguments leave the stack, the outputs take their place.
  static void return_outputs(torch::jit::Stack* stack, size_t n,
                             c10::SmallVector<at::Tensor, 4>& out) {
    torch::jit::drop(*stack, n);
    for (at::Tensor& tensor : out) {
      torch::jit::push(*stack, std::move(tensor));
    }
  }

  const CallTable* table_;   // held for the process's life (see the class comment)
  PyObject* python_kernel_;  // likewise
  c10::DispatchKeySet backend_;
};

// The registration of the ops' AutogradKernels and the table they read. Deleted only by
// unregister; at exit the dispatcher's own destruction frees the kernels (see
// AutogradKernel).
torch::Library* g_registration = nullptr;
const CallTable* g_registered_table = nullptr;

void register_autograd_kernels(const std::shared_ptr<CallTable>& table,
                               const std::string& backend,
                               const std::vector<std::pair<std::string, py::object>>& kernels) {
  if (g_registration != nullptr) {
    TORCH_CHECK(g_registered_table == table.get(),
                "csa_ops native: the Autograd kernels are registered with another table");
    return;  // the same table again: nothing to do
  }
  const c10::DispatchKey backend_key = c10::parseDispatchKey(backend);
  const c10::DispatchKey autograd_key = c10::getAutogradKeyFromBackend(
      c10::toBackendComponent(backend_key));
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "csa", autograd_key,
                                                  __FILE__, __LINE__);
  // One reference to the table for the process's life (never released: see AutogradKernel).
  const CallTable* held = (new std::shared_ptr<CallTable>(table))->get();
  for (const auto& [name, kernel] : kernels) {
    PyObject* function = kernel.inc_ref().ptr();  // never released either
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                     std::make_unique<AutogradKernel>(
                                         held, function, c10::DispatchKeySet(backend_key))));
  }
  g_registration = library.release();
  g_registered_table = held;
}

void unregister_autograd_kernels() {
  delete g_registration;
  g_registration = nullptr;
  g_registered_table = nullptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "csa_ops native launch path: prepared kernel calls in C++";
  m.attr("INPUT") = static_cast<int64_t>(kInput);
  m.attr("OUTPUT") = static_cast<int64_t>(kOutput);
  m.attr("WORKSPACE") = static_cast<int64_t>(kWorkspace);
  m.attr("CONSTANT") = static_cast<int64_t>(kConstant);
  py::class_<PreparedCall, std::shared_ptr<PreparedCall>>(m, "PreparedCall")
      .def(py::init<std::vector<std::pair<int64_t, Slots>>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<std::pair<int64_t, std::optional<std::vector<int64_t>>>>,
                    std::vector<std::pair<int64_t, int64_t>>, int64_t, int64_t>(),
           py::arg("launches"), py::arg("align"), py::arg("in_place"), py::arg("to_float"),
           py::arg("outputs"), py::arg("restore"), py::arg("workspace"), py::arg("live"))
      .def("__call__", &PreparedCall::operator());
  py::class_<CallTable, std::shared_ptr<CallTable>>(m, "CallTable")
      .def(py::init<>())
      .def("insert", &CallTable::insert, py::arg("call"), py::arg("tensors"))
      .def("__call__", &CallTable::operator())
      .def("clear", &CallTable::clear)
      .def("__len__", &CallTable::size);
  m.def("register_autograd_kernels", &register_autograd_kernels, py::arg("table"),
        py::arg("backend"), py::arg("kernels"),
        "Register the ops' C++ kernels at the Autograd key of `backend` (e.g. \"CUDA\"): "
        "kernels are (op name, Python Autograd kernel to defer to) pairs.");
  m.def("unregister_autograd_kernels", &unregister_autograd_kernels);
}
