"""Nothing that arrives on a socket is ever unpickled: no module of kvbaton imports a pickle-like deserializer or
calls one of pyzmq's pickling receives, msgpack is never given hooks that could build objects, torch.load and
numpy.load never allow pickles; and the two wire decoders refuse a pickle outright."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbaton"
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "jsonpickle"}
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized", "loads_pickle"}
MSGPACK_HOOKS = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook"}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_can_unpickle(path: Path) -> None:
    tree = ast.parse(path.read_text())
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [f"imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLERS:
            problems.append(f"imports from {node.module}")
        elif isinstance(node, ast.Call):
            callee = _callee(node)
            name = callee.rsplit(".", 1)[-1]
            if name in PICKLING_CALLS:
                problems.append(f"calls {callee}")
            if name in ("unpackb", "Unpacker") and any(_keyword(node, hook) is not None for hook in MSGPACK_HOOKS):
                problems.append(f"gives {callee} a hook that builds objects")
            if callee == "torch.load":
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    problems.append("torch.load without weights_only=True")
            if callee in ("np.load", "numpy.load"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    problems.append(f"{callee} with allow_pickle")
    assert not problems, f"{path.relative_to(SRC)}: {problems}"


class _Bomb:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("unpickled!",))


def test_the_wire_decoders_refuse_a_pickle() -> None:
    from kvbaton.server import rpc
    from kvbaton.transfer.codec import FrameError, decode

    payload = pickle.dumps(_Bomb())
    with pytest.raises(rpc.ProtocolError):
        rpc.decode(payload)
    with pytest.raises(FrameError):
        decode(payload)
