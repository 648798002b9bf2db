"""Static check of Python code against the real TensorRT (and polygraphy) API, by walking its AST.

Run as a script in a process where the real TensorRT bindings import (see `trt_bindings.py`):

    python tests/trt_api.py FILE.py ...   ->  JSON on stdout: {"tensorrt", "polygraphy", "findings", "checked"}

Every expression of every function is evaluated abstractly. Values that come from `tensorrt` or
`polygraphy` (imports, attributes of them, results of their calls, parameters annotated with a
TensorRT class) are tracked, and then:

- every attribute taken from them must exist (module attributes, enum members, methods and
  properties of builders, networks, configs, profiles, engines, contexts, loggers);
- every call of a pybind function or method must bind to one of the overloads its docstring
  declares (`name(self: T, a: int, b: str = ...) -> R`): argument count, keyword names, and the
  argument types that are known here (literals, TensorRT objects, enum members);
- every call of a polygraphy callable must bind to its Python signature;
- a class deriving from a TensorRT class may only define public methods the base has, with the
  base's arity, and its `__init__` must call the base `__init__`.

Results of TensorRT calls get the type their docstring returns, so `runtime.deserialize_cuda_engine(b)
.create_execution_context().set_input_shape(...)` is checked link by link. Values from anything else
(torch, numpy, our own objects) are unknown and not checked. The walk knows no TensorRT name by
heart: code that starts using another part of the API is covered without changing this file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import types
from pathlib import Path

TRACKED_ROOTS = ("tensorrt", "polygraphy")


# ---------------------------------------------------------------- pybind docstring signatures


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    annotation: str
    has_default: bool
    kind: str  # "plain", "positional_only", "var_positional", "var_keyword", "keyword_only"


@dataclasses.dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]
    returns: str

    def __str__(self) -> str:
        return "(" + ", ".join(f"{p.name}: {p.annotation}" for p in self.params) + f") -> {self.returns}"


SIGNATURE_LINE = re.compile(r"^(?:\d+\.\s+)?(\w*)\((.*)\)\s*(?:->\s*(.+))?$")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside brackets and quotes."""
    parts, depth, quote, current = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def parse_param(text: str, keyword_only: bool) -> Param | None:
    """One parameter of a pybind signature: `name: annotation [= default]`, `*args`, `**kwargs`."""
    if text in ("/", "*"):
        return None
    if text.startswith("**"):
        return Param(text[2:].split(":")[0].strip(), "", True, "var_keyword")
    if text.startswith("*"):
        return Param(text[1:].split(":")[0].strip(), "", True, "var_positional")
    head, *default = split_top_level(text, "=")
    name, _, annotation = head.partition(":")
    name = name.strip()
    kind = "keyword_only" if keyword_only else ("positional_only" if re.fullmatch(r"arg\d+", name) else "plain")
    return Param(name, annotation.strip(), bool(default), kind)


def parse_signature_line(line: str) -> Signature | None:
    match = SIGNATURE_LINE.match(line.strip())
    if match is None:
        return None
    params, keyword_only = [], False
    for text in split_top_level(match.group(2)):
        param = parse_param(text, keyword_only)
        if text == "*" or (text.startswith("*") and not text.startswith("**")):
            keyword_only = True
        if param is not None:
            params.append(param)
    return Signature(tuple(params), (match.group(3) or "").strip())


def pybind_signatures(obj) -> list[Signature] | None:
    """The overloads a pybind callable declares in its docstring; None when it declares none."""
    doc = getattr(obj, "__doc__", None) or ""
    lines = [line for line in doc.splitlines() if line.strip()]
    if not lines:
        return None
    if len(lines) > 1 and lines[1].strip() == "Overloaded function.":
        candidates = [line for line in lines[2:] if re.match(r"^\d+\.\s+\w*\(", line.strip())]
    else:
        candidates = lines[:1]
    signatures = [s for s in map(parse_signature_line, candidates) if s is not None]
    return signatures or None


def is_pybind(obj) -> bool:
    kind = type(obj)
    return (kind.__name__ in ("instancemethod", "builtin_function_or_method", "pybind11_type", "property")
            or type(kind).__name__ == "pybind11_type"
            or getattr(kind, "__module__", "") == "pybind11_builtins")


# ---------------------------------------------------------------- abstract values


class Unknown:
    """A value this walk does not track (torch, numpy, our own objects, arithmetic)."""


UNKNOWN = Unknown()


@dataclasses.dataclass(frozen=True)
class Real:
    """A real object of the tracked libraries: module, class, function, enum member."""

    obj: object
    path: str
    unbound: bool = False  # a method taken from its class (so `self` is passed explicitly)


@dataclasses.dataclass(frozen=True)
class Instance:
    """An instance of a real class (a TensorRT class, a polygraphy class) or of a local class."""

    cls: object
    path: str


@dataclasses.dataclass(frozen=True)
class BoundMethod:
    owner: Instance
    func: object
    path: str


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A value of a builtin type a TensorRT signature returned ("int", "bool", "str", ...)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Const:
    value: object


@dataclasses.dataclass
class LocalClass:
    name: str
    bases: list  # Real classes among the bases
    node: ast.ClassDef
    attributes: dict = dataclasses.field(default_factory=dict)  # self.<name> -> value
    methods: dict = dataclasses.field(default_factory=dict)  # name -> LocalFunction


@dataclasses.dataclass
class LocalFunction:
    node: ast.FunctionDef
    env: dict
    result: object = None
    evaluating: bool = False


BUILTIN_NAMES = {"int", "bool", "str", "float", "bytes", "None"}


def tracked_class(value) -> object | None:
    """The real class behind an `Instance` (also for local subclasses of real classes)."""
    if not isinstance(value, Instance):
        return None
    if isinstance(value.cls, LocalClass):
        return value.cls.bases[0].obj if value.cls.bases else None
    return value.cls


# ---------------------------------------------------------------- the checker


@dataclasses.dataclass
class Finding:
    file: str
    line: int
    message: str


class ModuleChecker:
    """Walks one module; `findings` collects every API mismatch, `checked` every tracked name used."""

    def __init__(self, path: Path, source: str | None = None):
        self.path = Path(path)
        self.tree = ast.parse(source if source is not None else self.path.read_text(), str(path))
        self.findings: list[Finding] = []
        self.checked: set[str] = set()
        self.module_env: dict = {}
        self.walked: set = set()  # (function, tracked argument types) already walked

    # -- reporting

    def report(self, node, message: str) -> None:
        finding = Finding(str(self.path), getattr(node, "lineno", 0), message)
        if finding not in self.findings:
            self.findings.append(finding)

    # -- imports

    def import_module(self, name: str, node):
        try:
            __import__(name)
        except ImportError as exc:
            self.report(node, f"cannot import {name}: {exc}")
            return UNKNOWN
        return Real(sys.modules[name], name)

    def bind_import(self, node, env: dict) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root not in TRACKED_ROOTS:
                    env[alias.asname or root] = UNKNOWN
                    continue
                module = self.import_module(alias.name, node)
                env[alias.asname or root] = module if alias.asname else self.import_module(root, node)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in TRACKED_ROOTS:
                for alias in node.names:
                    env[alias.asname or alias.name] = UNKNOWN
                return
            module = self.import_module(node.module, node)
            for alias in node.names:
                env[alias.asname or alias.name] = (self.attribute(module, alias.name, node)
                                                   if isinstance(module, Real) else UNKNOWN)
        else:
            for alias in node.names:
                env[alias.asname or alias.name] = UNKNOWN

    # -- module walk

    def run(self) -> "ModuleChecker":
        env = self.module_env
        self.exec_body(self.tree.body, env, scope="module")
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.evaluate_function(env[node.name])
        return self

    def exec_body(self, body, env: dict, scope: str = "function", self_value=None) -> list:
        returns = []
        for stmt in body:
            returns.extend(self.exec_stmt(stmt, env, scope, self_value))
        return returns

    def exec_stmt(self, stmt, env: dict, scope: str, self_value) -> list:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            self.bind_import(stmt, env)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in stmt.decorator_list:
                self.eval(decorator, env)
            env[stmt.name] = LocalFunction(stmt, env)
            if scope == "function":
                self.evaluate_function(env[stmt.name])
        elif isinstance(stmt, ast.ClassDef):
            env[stmt.name] = self.define_class(stmt, env)
        elif isinstance(stmt, ast.Assign):
            value = self.eval(stmt.value, env)
            for target in stmt.targets:
                self.assign(target, value, stmt.value, env, self_value)
        elif isinstance(stmt, ast.AnnAssign):
            value = self.eval(stmt.value, env) if stmt.value is not None else self.annotation_value(stmt.annotation)
            self.assign(stmt.target, value, stmt.value, env, self_value)
        elif isinstance(stmt, ast.AugAssign):
            self.eval(stmt.value, env)
            self.eval(stmt.target, env)
        elif isinstance(stmt, ast.Return):
            return [self.eval(stmt.value, env)] if stmt.value is not None else []
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.eval(stmt.iter, env)
            self.assign(stmt.target, UNKNOWN, None, env, self_value)
            return self.exec_body(stmt.body, env, scope, self_value) + self.exec_body(stmt.orelse, env, scope, self_value)
        elif isinstance(stmt, ast.While):
            self.eval(stmt.test, env)
            return self.exec_body(stmt.body, env, scope, self_value) + self.exec_body(stmt.orelse, env, scope, self_value)
        elif isinstance(stmt, ast.If):
            if scope == "module" and _is_type_checking(stmt.test):
                return self.exec_body(stmt.body, env, scope, self_value)
            self.eval(stmt.test, env)
            return self.exec_body(stmt.body, env, scope, self_value) + self.exec_body(stmt.orelse, env, scope, self_value)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                value = self.eval(item.context_expr, env)
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, value if isinstance(value, Instance) else UNKNOWN, None, env,
                                self_value)
            return self.exec_body(stmt.body, env, scope, self_value)
        elif isinstance(stmt, ast.Try):
            returns = self.exec_body(stmt.body, env, scope, self_value)
            for handler in stmt.handlers:
                if handler.type is not None:
                    self.eval(handler.type, env)
                if handler.name:
                    env[handler.name] = UNKNOWN
                returns += self.exec_body(handler.body, env, scope, self_value)
            return returns + self.exec_body(stmt.orelse, env, scope, self_value) + \
                self.exec_body(stmt.finalbody, env, scope, self_value)
        else:
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.expr):
                    self.eval(child, env)
        return []

    def assign(self, target, value, value_node, env: dict, self_value) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = value_node.elts if isinstance(value_node, (ast.Tuple, ast.List)) else None
            for i, element in enumerate(target.elts):
                if items is not None and len(items) == len(target.elts):
                    self.assign(element, self.eval(items[i], env), items[i], env, self_value)
                else:
                    self.assign(element, UNKNOWN, None, env, self_value)
        elif isinstance(target, ast.Attribute):
            owner = self.eval(target.value, env)
            if isinstance(owner, Instance) and isinstance(owner.cls, LocalClass):
                if not isinstance(value, Unknown) or target.attr not in owner.cls.attributes:
                    owner.cls.attributes[target.attr] = value
            elif isinstance(owner, (Real, Instance)):
                self.attribute(owner, target.attr, target)  # writing a TensorRT property: it must exist
        else:
            self.eval(target, env)

    # -- functions and classes

    def annotation_value(self, annotation):
        """`Instance` of the TensorRT class an annotation names (also as a string), else unknown."""
        if annotation is None:
            return UNKNOWN
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return UNKNOWN
        if not isinstance(annotation, (ast.Attribute, ast.Name)):
            return UNKNOWN
        value = self.eval(annotation, self.module_env)
        if isinstance(value, Real) and inspect.isclass(value.obj):
            return Instance(value.obj, value.path)
        return UNKNOWN

    def function_env(self, function: LocalFunction, self_value=None, bindings: dict | None = None) -> dict:
        env = dict(function.env)
        args = function.node.args
        positional = [*args.posonlyargs, *args.args]
        for i, arg in enumerate([*positional, *args.kwonlyargs]):
            env[arg.arg] = self_value if (i == 0 and self_value is not None) else self.annotation_value(arg.annotation)
        env.update(bindings or {})
        for arg in (args.vararg, args.kwarg):
            if arg is not None:
                env[arg.arg] = UNKNOWN
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                self.eval(default, function.env)
        return env

    def evaluate_function(self, function: LocalFunction, self_value=None, bindings: dict | None = None):
        """Walk `function`; returns the value of its (first tracked) return.

        Without `bindings` (tracked argument values by parameter name) it is walked once; with them
        once more per combination of argument types, so code receiving TensorRT objects from its
        callers is checked with them."""
        bindings = {k: v for k, v in (bindings or {}).items() if not isinstance(v, (Unknown, Const))}
        if bindings:
            key = (id(function.node), id(self_value), tuple(sorted((k, _describe_value(v)) for k, v in bindings.items())))
            if key in self.walked or function.evaluating:
                return UNKNOWN
            self.walked.add(key)
            return self.walk(function, self_value, bindings)
        if function.result is not None or function.evaluating:
            return function.result if function.result is not None else UNKNOWN
        function.result = self.walk(function, self_value, {})
        return function.result

    def walk(self, function: LocalFunction, self_value, bindings: dict):
        function.evaluating = True
        try:
            env = self.function_env(function, self_value, bindings)
            returns = self.exec_body(function.node.body, env, self_value=self_value)
        finally:
            function.evaluating = False
        tracked = [r for r in returns if not isinstance(r, Unknown)]
        return tracked[0] if tracked else UNKNOWN

    def local_bindings(self, function: LocalFunction, args: list, keywords: dict, skip_self: bool) -> dict:
        params = [a.arg for a in [*function.node.args.posonlyargs, *function.node.args.args]][int(skip_self):]
        bound = dict(zip(params, args))
        names = {a.arg for a in [*function.node.args.posonlyargs, *function.node.args.args,
                                 *function.node.args.kwonlyargs]}
        bound.update({k: v for k, v in keywords.items() if k in names})
        return bound

    def instantiate(self, cls: LocalClass, args: list, keywords: dict) -> Instance:
        """An instance of a local class; tracked constructor arguments re-walk `__init__` and the methods."""
        instance = Instance(cls, cls.name)
        init = cls.methods.get("__init__")
        if init is None:
            return instance
        bindings = self.local_bindings(init, args, keywords, skip_self=True)
        if any(not isinstance(v, (Unknown, Const)) for v in bindings.values()):
            before = len(self.walked)
            self.evaluate_function(init, instance, bindings)
            if len(self.walked) > before:
                for name, method in cls.methods.items():
                    if name != "__init__":
                        self.walk(method, instance, {})
        return instance

    def define_class(self, node: ast.ClassDef, env: dict) -> LocalClass:
        bases = [self.eval(base, env) for base in node.bases]
        real_bases = [b for b in bases if isinstance(b, Real) and inspect.isclass(b.obj)]
        cls = LocalClass(node.name, real_bases, node)
        instance = Instance(cls, node.name)
        methods = [s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods.sort(key=lambda s: s.name != "__init__")  # attributes set in __init__ first
        for stmt in node.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.exec_stmt(stmt, env, "class", None)
        for method in methods:
            if real_bases and is_pybind(real_bases[0].obj):
                self.check_override(cls, method)
            function = LocalFunction(method, env)
            is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in method.decorator_list)
            if not is_static:
                cls.methods[method.name] = function
            self.evaluate_function(function, None if is_static else instance)
        return cls

    def check_override(self, cls: LocalClass, method: ast.FunctionDef) -> None:
        base = cls.bases[0]
        name = method.name
        if name == "__init__":
            if not any(_calls_base_init(call) for call in ast.walk(method) if isinstance(call, ast.Call)):
                self.report(method, f"{cls.name}.__init__ must call {base.path}.__init__(self) (pybind base class)")
            return
        if name.startswith("_"):
            return
        if not hasattr(base.obj, name):
            self.report(method, f"{cls.name}.{name} overrides nothing: {base.path} has no method {name!r}")
            return
        self.checked.add(f"{base.path}.{name}")
        signatures = pybind_signatures(getattr(base.obj, name))
        if signatures:
            arity = len(method.args.posonlyargs) + len(method.args.args)
            wanted = {len([p for p in s.params if p.kind not in ("var_positional", "var_keyword")]) for s in signatures}
            if arity not in wanted and method.args.vararg is None:
                self.report(method, f"{cls.name}.{name} takes {arity} arguments, TensorRT calls it with "
                                    f"{' or '.join(map(str, sorted(wanted)))}: {signatures[0]}")

    # -- expressions

    def eval(self, node, env: dict):
        if node is None:
            return UNKNOWN
        if isinstance(node, ast.Constant):
            return Const(node.value)
        if isinstance(node, ast.Name):
            return env.get(node.id, self.module_env.get(node.id, UNKNOWN))
        if isinstance(node, ast.Attribute):
            return self.attribute(self.eval(node.value, env), node.attr, node)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Lambda):
            inner = dict(env)
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                inner[arg.arg] = UNKNOWN
            self.eval(node.body, inner)
            return UNKNOWN
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = dict(env)
            for generator in node.generators:
                self.eval(generator.iter, inner)
                self.assign(generator.target, UNKNOWN, None, inner, None)
                for condition in generator.ifs:
                    self.eval(condition, inner)
            for part in ((node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,)):
                self.eval(part, inner)
            return UNKNOWN
        if isinstance(node, ast.NamedExpr):
            value = self.eval(node.value, env)
            env[node.target.id] = value
            return value
        if isinstance(node, ast.IfExp):
            self.eval(node.test, env)
            body, orelse = self.eval(node.body, env), self.eval(node.orelse, env)
            return body if not isinstance(body, Unknown) else orelse
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.eval(child, env)
            elif isinstance(child, ast.comprehension):
                self.eval(child.iter, env)
        return UNKNOWN

    def attribute(self, owner, name: str, node):
        if isinstance(owner, Real):
            return self.real_attribute(owner, name, node)
        if isinstance(owner, Instance):
            return self.instance_attribute(owner, name, node)
        return UNKNOWN

    def real_attribute(self, owner: Real, name: str, node):
        path = f"{owner.path}.{name}"
        if not hasattr(owner.obj, name):
            if isinstance(owner.obj, types.ModuleType):
                try:  # a submodule not imported yet (polygraphy.backend.trt)
                    __import__(f"{owner.obj.__name__}.{name}")
                    return Real(sys.modules[f"{owner.obj.__name__}.{name}"], path)
                except ImportError:
                    pass
            self.report(node, f"{owner.path} has no attribute {name!r}")
            return UNKNOWN
        self.checked.add(path)
        value = getattr(owner.obj, name)
        unbound = inspect.isclass(owner.obj) and not isinstance(inspect.getattr_static(owner.obj, name, None),
                                                                  (staticmethod, classmethod)) \
            and (type(value).__name__ == "instancemethod" or inspect.isfunction(value))
        if isinstance(value, (int, float, str, bool)) and not is_pybind(value):
            return Const(value)
        return Real(value, path, unbound=unbound)

    def instance_attribute(self, owner: Instance, name: str, node):
        cls = owner.cls
        if isinstance(cls, LocalClass):
            if name in cls.attributes:
                return cls.attributes[name]
            if any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name for s in cls.node.body):
                return UNKNOWN
            if not cls.bases:
                return UNKNOWN
            cls = cls.bases[0].obj
        path = f"{getattr(cls, '__name__', owner.path)}.{name}"
        static = inspect.getattr_static(cls, name, _MISSING)
        if static is _MISSING:
            if not is_pybind(cls) and _set_in_init(cls, name):
                return UNKNOWN
            self.report(node, f"{getattr(cls, '__name__', owner.path)} has no attribute {name!r}")
            return UNKNOWN
        self.checked.add(path)
        if isinstance(static, property):
            return self.returned_value(static.fget, pybind_signatures(static.fget))
        value = getattr(cls, name)
        if callable(value) and not inspect.isclass(value):
            return BoundMethod(owner, value, path)
        return Real(value, path) if is_pybind(value) or inspect.isclass(value) else UNKNOWN

    # -- calls

    def call(self, node: ast.Call, env: dict):
        func = self.eval(node.func, env)
        args = [self.eval(a.value if isinstance(a, ast.Starred) else a, env) for a in node.args]
        keywords = {k.arg: self.eval(k.value, env) for k in node.keywords}
        starred = any(isinstance(a, ast.Starred) for a in node.args) or None in keywords
        keywords.pop(None, None)
        if isinstance(func, LocalFunction):
            return self.evaluate_function(func, None, self.local_bindings(func, args, keywords, skip_self=False))
        if isinstance(func, LocalClass):
            return self.instantiate(func, args, keywords)
        if isinstance(func, Builtin) and func.name in BUILTIN_NAMES:
            self.report(node, f"a {func.name} is not callable (a TensorRT property, not a method?)")
            return UNKNOWN
        if isinstance(func, BoundMethod):
            return self.call_real(node, func.func, func.path, [func.owner, *args], keywords, starred)
        if isinstance(func, Real):
            if inspect.isclass(func.obj):
                self.call_real(node, func.obj, func.path, args, keywords, starred, constructor=True)
                return Instance(func.obj, func.path)
            return self.call_real(node, func.obj, func.path, args, keywords, starred)
        if isinstance(func, Instance) and not isinstance(func.cls, LocalClass) and callable(func.cls):
            call = getattr(func.cls, "__call__", None)
            if call is not None and not is_pybind(func.cls):
                self.bind_python(node, call, f"{func.path}()", [func, *args], keywords, starred)
        return UNKNOWN

    def call_real(self, node, obj, path: str, args: list, keywords: dict, starred: bool, constructor=False):
        if is_pybind(obj if not constructor else obj.__init__) or (constructor and is_pybind(obj)):
            target = obj.__init__ if constructor else obj
            signatures = pybind_signatures(target)
            if signatures is None:
                return UNKNOWN
            if constructor:
                args = [Instance(obj, path), *args]
            self.checked.add(path + ("()" if constructor else ""))
            errors = [self.bind_pybind(s, args, keywords, starred) for s in signatures]
            if all(errors):
                shown = "; ".join(f"{s}: {e}" for s, e in zip(signatures, errors))
                self.report(node, f"{path}({_describe(args, keywords)}) matches no signature of the bindings: {shown}")
                return UNKNOWN
            match = signatures[errors.index(None)]
            return self.returned_value(target, [match])
        if constructor or callable(obj):
            self.bind_python(node, obj, path, args, keywords, starred)
        return UNKNOWN

    def bind_python(self, node, obj, path: str, args: list, keywords: dict, starred: bool) -> None:
        """Report a call that binds neither to `obj`'s signature nor to that of the wrapper it may be
        (a decorated function's `__wrapped__` signature is not always the one called)."""
        try:
            signature = inspect.signature(obj)
            outer = inspect.signature(obj, follow_wrapped=False)
        except (TypeError, ValueError):
            return
        self.checked.add(path + "()")
        if outer != signature and any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in outer.parameters.values()):
            return
        if starred:
            names = set(signature.parameters)
            takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
            unknown = [k for k in keywords if k not in names and not takes_any]
            if unknown:
                self.report(node, f"{path} has no parameter {unknown[0]!r}: {signature}")
            return
        placeholders = [object()] * len(args)
        try:
            signature.bind(*placeholders, **{k: object() for k in keywords})
        except TypeError as exc:
            self.report(node, f"{path}{signature} does not accept this call: {exc}")

    def bind_pybind(self, signature: Signature, args: list, keywords: dict, starred: bool) -> str | None:
        """None when the call binds to `signature`, else why not."""
        params = list(signature.params)
        if any(p.kind in ("var_positional", "var_keyword") for p in params):
            return None
        positional = [p for p in params if p.kind != "keyword_only"]
        if len(args) > len(positional) and not starred:
            return f"{len(args) - 1} positional arguments, at most {len(positional) - 1} accepted"
        bound = dict(zip([p.name for p in positional], args))
        for name, value in keywords.items():
            param = next((p for p in params if p.name == name), None)
            if param is None or param.kind == "positional_only":
                return f"no keyword argument {name!r}"
            if name in bound:
                return f"{name!r} given twice"
            bound[name] = value
        if not starred:
            missing = [p.name for p in params if p.name not in bound and not p.has_default]
            if missing:
                return f"missing {', '.join(missing)}"
        for param in params:
            if param.name in bound and not accepts(param.annotation, bound[param.name]):
                return f"{param.name} must be {param.annotation}, got {_describe_value(bound[param.name])}"
        return None

    def returned_value(self, target, signatures):
        if not signatures:
            return UNKNOWN
        returns = signatures[0].returns
        if returns in BUILTIN_NAMES:
            return Builtin(returns)
        cls = resolve_annotation(returns)
        return Instance(cls, returns.split(".")[-1]) if cls is not None else UNKNOWN


# ---------------------------------------------------------------- argument types


def resolve_annotation(text: str):
    """The TensorRT class a pybind annotation names (`tensorrt_bindings.tensorrt.ICudaEngine`), else None."""
    text = text.strip()
    for prefix in ("tensorrt_bindings.tensorrt.", "tensorrt.tensorrt.", "tensorrt."):
        if text.startswith(prefix):
            obj = sys.modules.get("tensorrt")
            for part in text[len(prefix):].split("."):
                obj = getattr(obj, part, None)
            return obj if inspect.isclass(obj) else None
    return None


INT_ANNOTATIONS = {"int", "typing.SupportsInt", "typing.SupportsIndex"}
FLOAT_ANNOTATIONS = {"float", "typing.SupportsFloat"}


def accepts(annotation: str, value) -> bool:
    """False only when `value` is known not to convert to `annotation` under pybind's rules."""
    if isinstance(value, Unknown) or not annotation or isinstance(value, (BoundMethod, LocalClass, LocalFunction)):
        return True
    optional = "None" in annotation or "Optional" in annotation
    if isinstance(value, Const):
        v = value.value
        if v is None:
            return optional
        if annotation in INT_ANNOTATIONS or annotation == "bool":
            return isinstance(v, (int, bool))
        if annotation in FLOAT_ANNOTATIONS:
            return isinstance(v, (int, float)) and not isinstance(v, bool) or isinstance(v, bool)
        if annotation == "str":
            return isinstance(v, str)
        cls = resolve_annotation(annotation)
        if cls is not None and hasattr(cls, "__members__"):
            return False  # TensorRT enums do not convert from literals
        return not (cls is not None and isinstance(v, str))
    if isinstance(value, Builtin):
        if annotation in INT_ANNOTATIONS or annotation in FLOAT_ANNOTATIONS or annotation == "bool":
            return value.name in ("int", "bool", "float") if annotation in FLOAT_ANNOTATIONS else value.name in ("int", "bool")
        if annotation == "str":
            return value.name == "str"
        return True
    real_cls = tracked_class(value)
    if isinstance(value, Real) and is_pybind(value.obj) and not inspect.isclass(value.obj):
        real_cls = type(value.obj)  # an enum member
    if real_cls is None:
        return True
    if annotation in INT_ANNOTATIONS | FLOAT_ANNOTATIONS | {"str", "bool"}:
        return False
    cls = resolve_annotation(annotation)
    if cls is None:
        return True
    return inspect.isclass(real_cls) and issubclass(real_cls, cls)


# ---------------------------------------------------------------- helpers


_MISSING = object()


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _calls_base_init(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr == "__init__"


def _set_in_init(cls, name: str) -> bool:
    """Whether some `__init__` in the MRO of a Python class assigns `self.<name>`."""
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        try:
            source = inspect.getsource(init) if init is not None else ""
        except (OSError, TypeError):
            return True  # cannot tell: do not report
        if re.search(rf"self\.{re.escape(name)}\s*[:=]", source):
            return True
    return False


def _describe_value(value) -> str:
    if isinstance(value, Const):
        return repr(value.value)
    if isinstance(value, Instance):
        return f"a {getattr(value.cls, '__name__', value.path) if not isinstance(value.cls, LocalClass) else value.cls.name}"
    if isinstance(value, Real):
        return value.path
    if isinstance(value, Builtin):
        return f"a {value.name}"
    return "?"


def _describe(args, keywords) -> str:
    return ", ".join([*map(_describe_value, args), *(f"{k}={_describe_value(v)}" for k, v in keywords.items())])


def imports_tracked(path: Path) -> bool:
    """Whether the module at `path` imports tensorrt or polygraphy anywhere (also inside functions)."""
    for node in ast.walk(ast.parse(Path(path).read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in TRACKED_ROOTS for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in TRACKED_ROOTS:
            return True
    return False


def use_bindings_as_tensorrt() -> None:
    """Make `import tensorrt` give the real bindings module (the bindings wheel installs `tensorrt_bindings`)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        import tensorrt_bindings

        sys.modules["tensorrt"] = tensorrt_bindings


def check_files(paths) -> dict:
    findings, checked = [], {}
    for path in paths:
        checker = ModuleChecker(Path(path)).run()
        findings += [dataclasses.asdict(f) for f in checker.findings]
        checked[str(path)] = sorted(checker.checked)
    return {"findings": findings, "checked": checked}


def main(argv: list[str]) -> int:
    use_bindings_as_tensorrt()
    import polygraphy
    import tensorrt

    result = {"tensorrt": tensorrt.__version__, "polygraphy": polygraphy.__version__,
              "max_dims": tensorrt.Dims.MAX_DIMS, **check_files(argv)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
