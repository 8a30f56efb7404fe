// versionwatch's optional native helper (see docs/native.md).
//
// check(roots): walks every autograd node reachable from `roots` and runs
// PyTorch's own check on every saved variable: SavedVariable::unpack in a
// try/catch, exactly what the Python predictor triggers through the generated
// `_saved_*` getters and what the engine runs before a node's formula. It
// returns (nodes, checked, flagged); flagged == 0 is a clean answer that the
// caller may use as is, anything else means "run the Python predictor".
//
// VersionSet(refs): the versions of some tensors, held weakly, as
// `[r()._version for r in refs]` reads them (None once one of them died).
//
// Everything that differs between torch releases is probed at compile time
// from the headers (never from version strings): how a Node is owned
// (std::shared_ptr through 2.10, c10::intrusive_ptr from 2.13), how a PyNode
// reaches its Python object (`obj` or `pyobj()`), how a THPFunction holds its
// node, and which fields a THPFunction has.

#include <Python.h>

#include <pybind11/pybind11.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#error "built by versionwatch._native_build, which names the extension"
#endif
#define VW_CAT2(a, b) a##b
#define VW_CAT(a, b) VW_CAT2(a, b)
#define VW_STR2(a) #a
#define VW_STR(a) VW_STR2(a)

namespace vw {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::PyNode;
using torch::autograd::SavedVariable;
using torch::autograd::Variable;

// -- compile-time probes -------------------------------------------------------

// How edges (and so the whole graph) own nodes.
using NodePtr = std::decay_t<decltype(std::declval<Edge&>().function)>;
constexpr bool kIntrusive = !std::is_same_v<NodePtr, std::shared_ptr<Node>>;

// PyNode::obj (through 2.10) or PyNode::pyobj() (2.13).
template <class T, class = void>
struct HasObjMember : std::false_type {};
template <class T>
struct HasObjMember<T, std::void_t<decltype(std::declval<T&>().obj)>>
    : std::true_type {};

template <class T>
PyObject* python_object_of(T* node) {
  if constexpr (HasObjMember<T>::value) {
    return node->obj;
  } else {
    return node->pyobj();
  }
}

// THPFunction::cdata: std::weak_ptr<PyNode>, c10::weak_intrusive_ptr<PyNode>
// (both have lock()) or c10::intrusive_ptr<Node> (an owning pointer).
template <class T, class = void>
struct HasLock : std::false_type {};
template <class T>
struct HasLock<T, std::void_t<decltype(std::declval<T&>().lock())>>
    : std::true_type {};

template <class P>
NodePtr owning(const P& p) {
  if constexpr (HasLock<P>::value) {
    return NodePtr(p.lock());
  } else {
    return NodePtr(p);
  }
}

// THPFunction fields that only some releases have.
template <class T, class = void>
struct HasClearOnAccess : std::false_type {};
template <class T>
struct HasClearOnAccess<
    T,
    std::void_t<
        decltype(std::declval<T&>().clear_saved_tensors_on_access),
        decltype(std::declval<T&>().saved_tensors_accessed_and_cleared)>>
    : std::true_type {};

template <class T>
bool clears_on_access(const T* f) {
  if constexpr (HasClearOnAccess<T>::value) {
    return f->clear_saved_tensors_on_access ||
        f->saved_tensors_accessed_and_cleared;
  } else {
    return false;
  }
}

template <class T, class = void>
struct HasSavedForForward : std::false_type {};
template <class T>
struct HasSavedForForward<
    T,
    std::void_t<decltype(std::declval<T&>().saved_for_forward)>>
    : std::true_type {};

template <class T>
bool saved_for_forward(const T* f) {
  if constexpr (HasSavedForForward<T>::value) {
    return f->saved_for_forward != nullptr;
  } else {
    return false;
  }
}

// -- node types ----------------------------------------------------------------

enum class Kind : uint8_t {
  kNoSaves,    // AccumulateGrad, GraphRoot, CopyBackwards: nothing to unpack
  kGenerated,  // torch::autograd::generated::*: SavedVariable members
  kPython,     // PyNode: a custom autograd.Function
  kUnsure,     // anything else: the Python predictor decides
};

struct TypeEntry {
  Kind kind = Kind::kUnsure;
  std::string name;  // demangled C++ type name
  std::string why;   // kUnsure: what made it so
  // kGenerated: where each SavedVariable member lies, from the Node*, learned
  // from the type's own `_raw_saved_*` getters (each returns a reference to
  // the member itself), and validated on a second instance.
  bool learned = false;
  bool validated = false;
  const Node* learned_from = nullptr;
  int failures = 0;
  std::vector<std::ptrdiff_t> offsets;
  std::vector<std::string> slots;
};

// Only touched with the GIL held. Entries live as long as the process (a type
// stays a type), so a pointer to one stays valid whatever is inserted later.
std::unordered_map<const std::type_info*, TypeEntry*>& types() {
  static auto* map = new std::unordered_map<const std::type_info*, TypeEntry*>();
  return *map;
}

int g_fault = 0;  // a test hook: 1 makes check() call everything clean

bool starts_with(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

TypeEntry* entry_for(const Node* node) {
  const std::type_info* ti = &typeid(*node);
  auto& map = types();
  auto it = map.find(ti);
  if (it != map.end()) {
    return it->second;
  }
  auto* e = new TypeEntry();
  // PyNode's typeinfo is not exported: names, not dynamic_cast.
  e->name = c10::demangle(ti->name());
  if (e->name == "torch::autograd::AccumulateGrad" ||
      e->name == "torch::autograd::GraphRoot" ||
      e->name == "torch::autograd::CopyBackwards") {
    e->kind = Kind::kNoSaves;
  } else if (e->name == "torch::autograd::PyNode") {
    e->kind = Kind::kPython;
  } else if (starts_with(e->name, "torch::autograd::generated::")) {
    e->kind = Kind::kGenerated;
  } else if (e->name == "torch::autograd::CopySlices") {
    e->why = "an in-place op on a view (CopySlices)";
  } else {
    e->why = "node type " + e->name;
  }
  auto [pos, inserted] = map.emplace(ti, e);
  if (!inserted) {
    delete e;
  }
  return pos->second;
}

enum class Learn { kOk, kList, kFailed };

// The SavedVariable members of `node`'s type, as offsets from the Node*, in
// the order of dir() (the Python predictor's order).
Learn learn(
    const NodePtr& node,
    std::vector<std::ptrdiff_t>& offsets,
    std::vector<std::string>& slots) {
  THPObjectPtr wrapper(torch::autograd::functionToPyObject(node));
  if (!wrapper) {
    PyErr_Clear();
    return Learn::kFailed;
  }
  THPObjectPtr names(PyObject_Dir(wrapper.get()));
  if (!names || !PyList_Check(names.get())) {
    PyErr_Clear();
    return Learn::kFailed;
  }
  static const char kRaw[] = "_raw_saved_";
  const Py_ssize_t n = PyList_GET_SIZE(names.get());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* name = PyList_GET_ITEM(names.get(), i);
    const char* text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
    if (text == nullptr) {
      PyErr_Clear();
      return Learn::kFailed;
    }
    if (std::strncmp(text, kRaw, sizeof(kRaw) - 1) != 0) {
      continue;
    }
    THPObjectPtr raw(PyObject_GetAttr(wrapper.get(), name));
    if (!raw) {
      PyErr_Clear();  // a released list slot refuses to show itself
      return Learn::kFailed;
    }
    if (PyTuple_Check(raw.get()) || PyList_Check(raw.get())) {
      return Learn::kList;
    }
    if (raw.get() == Py_None) {
      return Learn::kFailed;
    }
    const SavedVariable* sv = nullptr;
    try {
      sv = pybind11::handle(raw.get()).cast<const SavedVariable*>();
    } catch (...) {
      PyErr_Clear();
      return Learn::kFailed;
    }
    const auto offset = reinterpret_cast<const char*>(sv) -
        reinterpret_cast<const char*>(node.get());
    // A generated node's members follow its Node base, in a small object.
    if (sv == nullptr || offset < static_cast<std::ptrdiff_t>(sizeof(Node)) ||
        offset > (1 << 16)) {
      return Learn::kFailed;
    }
    offsets.push_back(offset);
    slots.emplace_back(text + sizeof(kRaw) - 1);
  }
  return Learn::kOk;
}

// -- the check -----------------------------------------------------------------

struct Finding {
  std::string node;
  std::string slot;
  std::string verdict;  // "error" (PyTorch raised) or "unsure"
  std::string detail;
};

struct Tally {
  int64_t nodes = 0;
  int64_t checked = 0;
  int64_t flagged = 0;
  std::vector<Finding>* findings = nullptr;  // explain() only

  void note(const Node* node, const std::string& slot, const char* verdict,
            const std::string& detail) {
    if (findings != nullptr) {
      findings->push_back({node->name(), slot, verdict, detail});
    }
  }
};

std::string message_of(const std::exception& e) {
  if (auto* err = dynamic_cast<const c10::Error*>(&e)) {
    return err->what_without_backtrace();
  }
  return e.what();
}

enum class Slot { kOk, kError, kUnsure };

// One saved variable, as the engine and the Python getter read it.
Slot check_slot(
    const SavedVariable& sv,
    const NodePtr& node,
    bool engine_gap,
    Tally& tally,
    const std::string& slot,
    Variable& value) {
  if (sv.has_hooks()) {
    // Unpacking would run the user's unpack hook.
    tally.note(node.get(), slot, "unsure", "behind saved_tensors_hooks");
    return Slot::kUnsure;
  }
  try {
    // With the node, as the generated `_saved_*` getter passes it (a saved
    // output needs it).
    value = sv.unpack(node);
  } catch (const std::exception& e) {
    tally.note(node.get(), slot, "error", message_of(e));
    return Slot::kError;
  }
  if (engine_gap && value.defined() && !value.grad_fn()) {
    // The engine unpacks a saved *input* without the node: a non-leaf that
    // was detached in place since then passes above and fails there.
    try {
      (void)sv.unpack();
    } catch (const std::exception& e) {
      tally.note(node.get(), slot, "unsure",
                 "detached in place since it was saved: " + message_of(e));
      return Slot::kUnsure;
    }
  }
  return Slot::kOk;
}

void check_generated(const NodePtr& node, TypeEntry* e, Tally& tally) {
  Node* n = node.get();
  if (!e->learned || (!e->validated && e->learned_from != n)) {
    std::vector<std::ptrdiff_t> offsets;
    std::vector<std::string> slots;
    const Learn got = learn(node, offsets, slots);
    if (got == Learn::kList) {
      e->kind = Kind::kUnsure;
      e->why = "a list of saved tensors";
    } else if (got == Learn::kFailed) {
      if (++e->failures >= 8) {
        e->kind = Kind::kUnsure;
        e->why = "its saved tensors could not be located";
      }
      tally.note(n, "", "unsure", "its saved tensors could not be located");
      ++tally.flagged;
      return;
    } else if (!e->learned) {
      e->offsets = std::move(offsets);
      e->slots = std::move(slots);
      e->learned_from = n;
      e->learned = true;
    } else if (offsets == e->offsets) {
      e->validated = true;
    } else {
      e->kind = Kind::kUnsure;
      e->why = "its saved tensors lie at different places in two nodes";
    }
    if (e->kind == Kind::kUnsure) {
      tally.note(n, "", "unsure", e->why);
      ++tally.flagged;
      return;
    }
  }
  bool bad = false;
  const char* base = reinterpret_cast<const char*>(n);
  for (size_t k = 0; k < e->offsets.size(); ++k) {
    const auto& sv =
        *reinterpret_cast<const SavedVariable*>(base + e->offsets[k]);
    static const std::string kNone;
    Variable value;
    const Slot s = check_slot(
        sv, node, true, tally, tally.findings ? e->slots[k] : kNone, value);
    if (s == Slot::kOk) {
      ++tally.checked;
    } else {
      bad = true;
    }
  }
  if (bad) {
    ++tally.flagged;
  }
}

void check_python(const NodePtr& node, Tally& tally) {
  auto* pn = static_cast<PyNode*>(node.get());
  PyObject* obj = python_object_of(pn);
  const char* why = nullptr;
  auto* f = reinterpret_cast<THPFunction*>(obj);
  if (obj == nullptr) {
    why = "a custom Function without its Python object";
  } else if (std::strcmp(Py_TYPE(obj)->tp_name, "CheckpointFunctionBackward") == 0) {
    why = "a reentrant checkpoint reruns its forward";
  } else if (f->has_freed_buffers) {
    tally.note(pn, "saved_tensors", "error", torch::autograd::ERR_BACKWARD_TWICE);
    ++tally.flagged;
    return;
  } else if (clears_on_access(f)) {
    why = "clear_saved_tensors_on_access";
  } else if (saved_for_forward(f)) {
    why = "saved for a forward-mode gradient";
  }
  if (why == nullptr) {
    for (const auto& sv : f->saved_variables) {
      if (sv.has_hooks()) {
        why = "behind saved_tensors_hooks";
        break;
      }
    }
  }
  if (why != nullptr) {
    tally.note(pn, "saved_tensors", "unsure", why);
    ++tally.flagged;
    return;
  }
  bool bad = false;
  int64_t k = 0;
  for (const auto& sv : f->saved_variables) {
    const std::string slot =
        tally.findings ? "saved_tensors[" + std::to_string(k) + "]" : "";
    ++k;
    // ctx.saved_tensors unpacks each with the node, in the engine as here.
    Variable value;
    const Slot s = check_slot(sv, node, false, tally, slot, value);
    if (s != Slot::kOk) {
      bad = true;
      continue;
    }
    if (!value.defined()) {
      // A saved None: the Python predictor counts it on some releases only.
      tally.note(pn, slot, "unsure", "a saved None");
      bad = true;
    }
  }
  if (bad) {
    ++tally.flagged;
  } else {
    tally.checked += static_cast<int64_t>(f->saved_variables.size());
  }
}

// The node behind a Python Node object (a C++ node's wrapper or a custom
// Function's ctx), or null.
NodePtr node_of(PyObject* obj) {
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return NodePtr(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  }
  const int is_fn = PyObject_IsInstance(obj, reinterpret_cast<PyObject*>(&THPFunctionType));
  if (is_fn < 0) {
    PyErr_Clear();
    return NodePtr();
  }
  if (is_fn) {
    return owning(reinterpret_cast<THPFunction*>(obj)->cdata);
  }
  return NodePtr();
}

// Returns false with a Python error set when `roots` is not a sequence.
bool run(PyObject* roots, Tally& tally) {
  THPObjectPtr seq(PySequence_Fast(roots, "roots must be a sequence of autograd nodes"));
  if (!seq) {
    return false;
  }
  const Py_ssize_t n_roots = PySequence_Fast_GET_SIZE(seq.get());
  PyObject** items = PySequence_Fast_ITEMS(seq.get());
  std::vector<NodePtr> nodes;
  std::unordered_set<const Node*> seen;
  nodes.reserve(32);
  seen.reserve(64);
  for (Py_ssize_t i = 0; i < n_roots; ++i) {
    NodePtr p = node_of(items[i]);
    if (!p) {
      if (tally.findings != nullptr) {
        tally.findings->push_back(
            {"", "", "unsure", std::string("a root that is no autograd node: ") +
                 Py_TYPE(items[i])->tp_name});
      }
      ++tally.flagged;
      continue;
    }
    if (seen.insert(p.get()).second) {
      nodes.push_back(std::move(p));
    }
  }
  // Breadth first, as the Python walk: every node reachable from the roots.
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node* n = nodes[i].get();
    for (const Edge& edge : n->next_edges()) {
      const Node* child = edge.function.get();
      if (child != nullptr && seen.insert(child).second) {
        nodes.push_back(edge.function);
      }
    }
  }
  tally.nodes = static_cast<int64_t>(nodes.size());
  for (const NodePtr& node : nodes) {
    TypeEntry* e = entry_for(node.get());
    switch (e->kind) {
      case Kind::kNoSaves:
        break;
      case Kind::kGenerated:
        check_generated(node, e, tally);
        break;
      case Kind::kPython:
        check_python(node, tally);
        break;
      case Kind::kUnsure:
        tally.note(node.get(), "", "unsure", e->why);
        ++tally.flagged;
        break;
    }
  }
  return true;
}

PyObject* check(PyObject* /*module*/, PyObject* roots) {
  HANDLE_TH_ERRORS
  Tally tally;
  if (!run(roots, tally)) {
    return nullptr;
  }
  if (g_fault == 1) {
    tally.flagged = 0;
  }
  return Py_BuildValue("(LLL)", static_cast<long long>(tally.nodes),
                       static_cast<long long>(tally.checked),
                       static_cast<long long>(tally.flagged));
  END_HANDLE_TH_ERRORS
}

PyObject* explain(PyObject* /*module*/, PyObject* roots) {
  HANDLE_TH_ERRORS
  std::vector<Finding> findings;
  Tally tally;
  tally.findings = &findings;
  if (!run(roots, tally)) {
    return nullptr;
  }
  THPObjectPtr out(PyList_New(static_cast<Py_ssize_t>(findings.size())));
  if (!out) {
    return nullptr;
  }
  for (size_t i = 0; i < findings.size(); ++i) {
    const Finding& f = findings[i];
    PyObject* item = Py_BuildValue(
        "(ssss)", f.node.c_str(), f.slot.c_str(), f.verdict.c_str(), f.detail.c_str());
    if (item == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(out.get(), static_cast<Py_ssize_t>(i), item);
  }
  return out.release();
  END_HANDLE_TH_ERRORS
}

PyObject* set_fault(PyObject* /*module*/, PyObject* arg) {
  const long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  g_fault = static_cast<int>(v);
  Py_RETURN_NONE;
}

PyObject* info(PyObject* /*module*/, PyObject* /*unused*/) {
  return Py_BuildValue(
      "{s:s,s:s,s:s,s:O,s:n}",
      "node_pointer", kIntrusive ? "intrusive_ptr" : "shared_ptr",
      "pynode_object", HasObjMember<PyNode>::value ? "obj" : "pyobj()",
      "function_cdata",
      HasLock<std::decay_t<decltype(std::declval<THPFunction&>().cdata)>>::value
          ? "weak"
          : "owning",
      "clear_saved_tensors_on_access",
      HasClearOnAccess<THPFunction>::value ? Py_True : Py_False,
      "node_types", static_cast<Py_ssize_t>(types().size()));
}

// -- VersionSet ----------------------------------------------------------------

struct VersionSet {
  PyObject_HEAD
  std::vector<PyObject*>* refs;  // weakref objects (owned references)
  std::vector<int64_t>* last;    // versions at the last read()/construction
  bool has_last;
};

// The referent of a weakref as a new reference, or null when it died.
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  return obj;
#else
  PyObject* obj = PyWeakref_GET_OBJECT(ref);
  if (obj == Py_None) {
    return nullptr;
  }
  Py_INCREF(obj);
  return obj;
#endif
}

enum class Read { kOk, kDead, kError };

// `obj._version`, as Tensor's own getter computes it: natively unless a
// __torch_function__ (a subclass's or a mode's) would see the access.
Read version_of(PyObject* obj, bool mode, int64_t& out) {
  if (!mode && THPVariable_CheckExact(obj)) {
    // What Tensor._version returns (VariableHooks::_version), without the
    // two calls in between.
    out = THPVariable_Unpack(obj).unsafeGetTensorImpl()->version_counter().current_version();
    return Read::kOk;
  }
  THPObjectPtr v(PyObject_GetAttrString(obj, "_version"));
  if (!v) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();  // read_versions: no _version reads as a dead tensor
      return Read::kDead;
    }
    return Read::kError;
  }
  out = PyLong_AsLongLong(v.get());
  if (out == -1 && PyErr_Occurred()) {
    return Read::kError;
  }
  return Read::kOk;
}

// Reads every version into `now`; kDead as soon as one tensor died.
Read read_all(VersionSet* self, std::vector<int64_t>& now) {
  const bool mode = at::impl::torch_function_mode_enabled();
  const auto& refs = *self->refs;
  now.resize(refs.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    PyObject* obj = referent(refs[i]);
    if (obj == nullptr) {
      return Read::kDead;
    }
    const Read r = version_of(obj, mode, now[i]);
    Py_DECREF(obj);
    if (r != Read::kOk) {
      return r;
    }
  }
  return Read::kOk;
}

PyObject* VersionSet_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  PyObject* items = nullptr;
  static const char* kw[] = {"tensors", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:VersionSet", const_cast<char**>(kw), &items)) {
    return nullptr;
  }
  THPObjectPtr seq(PySequence_Fast(items, "VersionSet takes a sequence of tensors or weakrefs"));
  if (!seq) {
    return nullptr;
  }
  THPObjectPtr self_obj(type->tp_alloc(type, 0));
  if (!self_obj) {
    return nullptr;
  }
  auto* self = reinterpret_cast<VersionSet*>(self_obj.get());
  self->refs = new std::vector<PyObject*>();
  self->last = new std::vector<int64_t>();
  self->has_last = false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  PyObject** elems = PySequence_Fast_ITEMS(seq.get());
  self->refs->reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = elems[i];
    PyObject* ref = nullptr;
    if (PyWeakref_CheckRef(item)) {
      Py_INCREF(item);
      ref = item;
    } else if (THPVariable_Check(item)) {
      ref = PyWeakref_NewRef(item, nullptr);
      if (ref == nullptr) {
        return nullptr;
      }
    } else {
      PyErr_Format(PyExc_TypeError,
                   "VersionSet takes tensors or weakref.ref objects; item %zd is %s",
                   i, Py_TYPE(item)->tp_name);
      return nullptr;
    }
    self->refs->push_back(ref);
  }
  const Read r = read_all(self, *self->last);
  if (r == Read::kError) {
    return nullptr;
  }
  self->has_last = r == Read::kOk;
  return self_obj.release();
  END_HANDLE_TH_ERRORS
}

void VersionSet_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<VersionSet*>(obj);
  if (self->refs != nullptr) {
    for (PyObject* r : *self->refs) {
      Py_DECREF(r);
    }
    delete self->refs;
  }
  delete self->last;
  Py_TYPE(obj)->tp_free(obj);
}

PyObject* VersionSet_versions(PyObject* obj, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<VersionSet*>(obj);
  std::vector<int64_t> now;
  const Read r = read_all(self, now);
  if (r == Read::kError) {
    return nullptr;
  }
  if (r == Read::kDead) {
    Py_RETURN_NONE;
  }
  THPObjectPtr list(PyList_New(static_cast<Py_ssize_t>(now.size())));
  if (!list) {
    return nullptr;
  }
  for (size_t i = 0; i < now.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(now[i]);
    if (v == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(i), v);
  }
  self->last->swap(now);
  self->has_last = true;
  return list.release();
  END_HANDLE_TH_ERRORS
}

PyObject* VersionSet_changed(PyObject* obj, PyObject* /*unused*/) {
  HANDLE_TH_ERRORS
  auto* self = reinterpret_cast<VersionSet*>(obj);
  const bool mode = at::impl::torch_function_mode_enabled();
  const auto& refs = *self->refs;
  const auto& last = *self->last;
  bool changed = !self->has_last;
  for (size_t i = 0; i < refs.size(); ++i) {
    PyObject* t = referent(refs[i]);
    if (t == nullptr) {
      Py_RETURN_NONE;
    }
    int64_t v = 0;
    const Read r = version_of(t, mode, v);
    Py_DECREF(t);
    if (r == Read::kError) {
      return nullptr;
    }
    if (r == Read::kDead) {
      Py_RETURN_NONE;
    }
    if (!changed && v != last[i]) {
      changed = true;  // read on: a dead tensor further on still says None
    }
  }
  if (changed) {
    Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

Py_ssize_t VersionSet_len(PyObject* obj) {
  return static_cast<Py_ssize_t>(reinterpret_cast<VersionSet*>(obj)->refs->size());
}

PyMethodDef VersionSet_methods[] = {
    {"versions", VersionSet_versions, METH_NOARGS,
     "The versions now, as [r()._version for r in refs]; None once a tensor died. "
     "They become the baseline of changed()."},
    {"changed", VersionSet_changed, METH_NOARGS,
     "Whether a version differs from the baseline (the last versions() or the "
     "construction); None once a tensor died."},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods VersionSet_as_sequence = {VersionSet_len};

PyTypeObject VersionSetType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyMethodDef module_methods[] = {
    {"check", check, METH_O,
     "check(roots) -> (nodes, checked, flagged): flagged == 0 is a clean answer."},
    {"explain", explain, METH_O,
     "explain(roots) -> [(node, slot, verdict, detail)] for what check() flagged."},
    {"_set_fault", set_fault, METH_O, "Test hook: 1 makes check() call everything clean."},
    {"_info", info, METH_NOARGS, "What the headers of this build provided."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, VW_STR(TORCH_EXTENSION_NAME),
    "versionwatch's optional native helper", -1, module_methods};

}  // namespace vw

PyMODINIT_FUNC VW_CAT(PyInit_, TORCH_EXTENSION_NAME)() {
  using namespace vw;
#ifdef Py_GIL_DISABLED
  // The type table and the walk rely on the GIL to keep other threads out.
  PyErr_SetString(PyExc_ImportError,
                  "versionwatch's native helper needs a Python with the GIL");
  return nullptr;
#endif
  VersionSetType.tp_name = VW_STR(TORCH_EXTENSION_NAME) ".VersionSet";
  VersionSetType.tp_basicsize = sizeof(VersionSet);
  VersionSetType.tp_dealloc = VersionSet_dealloc;
  VersionSetType.tp_flags = Py_TPFLAGS_DEFAULT;
  VersionSetType.tp_doc =
      "VersionSet(tensors or weakrefs): their versions, read as read_versions reads them.";
  VersionSetType.tp_methods = VersionSet_methods;
  VersionSetType.tp_as_sequence = &VersionSet_as_sequence;
  VersionSetType.tp_new = VersionSet_new;
  if (PyType_Ready(&VersionSetType) < 0) {
    return nullptr;
  }
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) {
    return nullptr;
  }
  Py_INCREF(&VersionSetType);
  if (PyModule_AddObject(m, "VersionSet", reinterpret_cast<PyObject*>(&VersionSetType)) < 0) {
    Py_DECREF(&VersionSetType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
