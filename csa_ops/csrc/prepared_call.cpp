// csa_ops native launch path: a prepared kernel call (one validated call signature) whose
// per-call work runs in C++ with torch's own allocator and current stream.
//
// Why: in Python each output allocation costs 2-6 us and each launch a few more, which puts
// the ops' eager calls at several times a torch.add. Here the outputs come from at::empty
// (torch's caching allocator, so CUDA-graph trees and record_stream work as for any torch
// tensor) and the compiled kernel, a TVM-FFI function, is called through the TVM-FFI C API.
//
// Nothing here knows the kernels' argument list: Python hands over a program, one slot per
// kernel argument (an input's, output's or the workspace's address, or a constant), built
// from csa_ops.host.ARGUMENTS, the one statement of that list. The stream follows the slots.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <tvm/ffi/c_api.h>

#include <cstdint>
#include <memory>
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
// host time goes to four allocations. The caller holds a guard of `device`.
at::Tensor allocate(c10::IntArrayRef shape, at::ScalarType dtype, const c10::Device& device) {
  return at::detail::empty_generic(shape, c10::GetAllocator(device.type()),
                                   c10::DispatchKeySet(c10::computeDispatchKey(
                                       dtype, c10::kStrided, device)),
                                   dtype, c10::MemoryFormat::Contiguous);
}

class PreparedCall {
 public:
  // function: a TVM-FFI function handle (held for this object's life).
  // slots: (source, value) per kernel argument: input/output index, 0 for the workspace,
  //   or the constant itself.
  // align: per input, the byte alignment the kernel assumes (0: none); a misaligned input
  //   (a view starting mid-allocation) is copied first.
  // to_float: inputs the kernel reads as fp32 (ape in any float dtype).
  // outputs: (like, shape or None) per output.
  // restore: (output, input) pairs: the output is cast back to the input's dtype as passed.
  // workspace: fp32 elements of scratch, 0 for none.
  PreparedCall(int64_t function, std::vector<std::pair<int64_t, int64_t>> slots,
               std::vector<int64_t> align, std::vector<int64_t> to_float,
               std::vector<std::pair<int64_t, std::optional<std::vector<int64_t>>>> outputs,
               std::vector<std::pair<int64_t, int64_t>> restore, int64_t workspace)
      : function_(reinterpret_cast<TVMFFIObjectHandle>(function)),
        slots_(std::move(slots)),
        align_(std::move(align)),
        to_float_(std::move(to_float)),
        restore_(std::move(restore)),
        workspace_(workspace) {
    TORCH_CHECK(function_ != nullptr, "PreparedCall: function is a null handle");
    TORCH_CHECK(slots_.size() + 1 <= kMaxSlots, "PreparedCall: ", slots_.size(),
                " slots, at most ", kMaxSlots - 1);
    const auto inputs = static_cast<int64_t>(align_.size());
    for (const auto& [like, shape] : outputs) {
      TORCH_CHECK(0 <= like && like < inputs, "PreparedCall: output like input ", like,
                  " of ", inputs);
      outputs_.push_back({like, shape.value_or(std::vector<int64_t>{}), shape.has_value()});
    }
    const auto num_outputs = static_cast<int64_t>(outputs_.size());
    for (const auto& [source, value] : slots_) {
      const bool ok = (source == kInput && 0 <= value && value < inputs) ||
                      (source == kOutput && 0 <= value && value < num_outputs) ||
                      (source == kWorkspace && workspace_ > 0) || source == kConstant;
      TORCH_CHECK(ok, "PreparedCall: bad slot (", source, ", ", value, ")");
    }
    for (int64_t i : to_float_) {
      TORCH_CHECK(0 <= i && i < inputs, "PreparedCall: to_float input ", i, " of ", inputs);
    }
    for (const auto& [out, in] : restore_) {
      TORCH_CHECK(0 <= out && out < num_outputs && 0 <= in && in < inputs,
                  "PreparedCall: bad restore pair (", out, ", ", in, ")");
    }
    TVMFFIObjectIncRef(function_);
  }

  ~PreparedCall() { TVMFFIObjectDecRef(function_); }
  PreparedCall(const PreparedCall&) = delete;
  PreparedCall& operator=(const PreparedCall&) = delete;

  // The call: the op's tensors in schema order; returns the output, or a tuple of them.
  py::object operator()(const py::args& args) const {
    const size_t n = align_.size();
    TORCH_CHECK(args.size() == n, "csa_ops native call: expected ", n, " tensors, got ",
                args.size());
    c10::SmallVector<at::Tensor, 8> in;
    c10::SmallVector<at::ScalarType, 8> passed;
    for (size_t i = 0; i < n; ++i) {
      PyObject* obj = args[i].ptr();
      TORCH_CHECK(THPVariable_Check(obj), "csa_ops native call: argument ", i,
                  " is not a tensor");
      const at::Tensor& tensor = THPVariable_Unpack(obj);
      passed.push_back(tensor.scalar_type());
      in.push_back(tensor.contiguous());
    }
    for (int64_t i : to_float_) {
      in[i] = in[i].to(at::kFloat);
    }
    for (size_t i = 0; i < n; ++i) {
      if (align_[i] != 0 && reinterpret_cast<uintptr_t>(in[i].data_ptr()) % align_[i] != 0) {
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

    TVMFFIAny argv[kMaxSlots];
    size_t k = 0;
    for (const auto& [source, value] : slots_) {
      int64_t v = value;
      if (source == kInput) {
        v = reinterpret_cast<int64_t>(in[value].data_ptr());
      } else if (source == kOutput) {
        v = reinterpret_cast<int64_t>(out[value].data_ptr());
      } else if (source == kWorkspace) {
        v = reinterpret_cast<int64_t>(workspace.data_ptr());
      }
      set_int(argv[k++], v);
    }
    set_int(argv[k++], current_stream(device));
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    if (TVMFFIFunctionCall(function_, argv, static_cast<int32_t>(k), &result) != 0) {
      raise_ffi_error();
    }
    if (result.type_index >= kTVMFFIStaticObjectBegin) {
      TVMFFIObjectDecRef(result.v_obj);
    }

    for (const auto& [o, i] : restore_) {
      out[o] = out[o].to(passed[i]);
    }
    if (out.size() == 1) {
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[0])));
    }
    py::tuple result_tuple(out.size());
    for (size_t j = 0; j < out.size(); ++j) {
      result_tuple[j] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[j])));
    }
    return result_tuple;
  }

 private:
  static void set_int(TVMFFIAny& any, int64_t value) {
    any.type_index = kTVMFFIInt;
    any.zero_padding = 0;
    any.v_int64 = value;
  }

  TVMFFIObjectHandle function_;
  std::vector<std::pair<int64_t, int64_t>> slots_;
  std::vector<int64_t> align_;
  std::vector<int64_t> to_float_;
  std::vector<OutputSpec> outputs_;
  std::vector<std::pair<int64_t, int64_t>> restore_;
  int64_t workspace_;
};

// Metadata signature -> prepared call, looked up and called in one step: what
// csa_ops.dispatch's memo does in Python, where building the signature alone costs more than
// a quarter of a call. A signature is the bytes of each argument's metadata: a tensor's
// shape, dtype and device, an int's value, None. A call whose signature is absent (or holds
// anything else) returns None and takes the Python route, which validates and prepares it.
class CallTable {
 public:
  void insert(std::shared_ptr<PreparedCall> call, size_t tensors, const py::args& args) {
    std::string key;
    TORCH_CHECK(signature(args, key), "CallTable.insert: unsupported argument");
    entries_[key] = Entry{std::move(call), tensors};
  }

  py::object operator()(const py::args& args) const {
    std::string key;
    if (!signature(args, key)) {
      return py::none();
    }
    const auto found = entries_.find(key);
    if (found == entries_.end()) {
      return py::none();
    }
    return (*found->second.call)(py::args(args[py::slice(0, found->second.tensors, 1)]));
  }

  void clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::shared_ptr<PreparedCall> call;
    size_t tensors;  // the call takes the leading arguments; the rest are its scalars
  };

  static void put(std::string& key, int64_t value) {
    key.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }

  static bool signature(const py::args& args, std::string& key) {
    key.reserve(args.size() * 40);
    for (const py::handle& arg : args) {
      PyObject* obj = arg.ptr();
      if (THPVariable_Check(obj)) {
        const at::Tensor& tensor = THPVariable_Unpack(obj);
        put(key, 'T');
        put(key, tensor.dim());
        for (int64_t size : tensor.sizes()) {
          put(key, size);
        }
        put(key, static_cast<int64_t>(tensor.scalar_type()));
        put(key, static_cast<int64_t>(tensor.device().type()));
        put(key, tensor.device().index());
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

  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "csa_ops native launch path: prepared kernel calls in C++";
  m.attr("INPUT") = static_cast<int64_t>(kInput);
  m.attr("OUTPUT") = static_cast<int64_t>(kOutput);
  m.attr("WORKSPACE") = static_cast<int64_t>(kWorkspace);
  m.attr("CONSTANT") = static_cast<int64_t>(kConstant);
  py::class_<PreparedCall, std::shared_ptr<PreparedCall>>(m, "PreparedCall")
      .def(py::init<int64_t, std::vector<std::pair<int64_t, int64_t>>, std::vector<int64_t>,
                    std::vector<int64_t>,
                    std::vector<std::pair<int64_t, std::optional<std::vector<int64_t>>>>,
                    std::vector<std::pair<int64_t, int64_t>>, int64_t>(),
           py::arg("function"), py::arg("slots"), py::arg("align"), py::arg("to_float"),
           py::arg("outputs"), py::arg("restore"), py::arg("workspace"))
      .def("__call__", &PreparedCall::operator());
  py::class_<CallTable>(m, "CallTable")
      .def(py::init<>())
      .def("insert", &CallTable::insert, py::arg("call"), py::arg("tensors"))
      .def("__call__", &CallTable::operator())
      .def("clear", &CallTable::clear)
      .def("__len__", &CallTable::size);
}
