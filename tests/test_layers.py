"""The package's layers: nothing imports upward, not even lazily inside a function.

A newcomer reads the design off this table: plumbing and vocabulary at the bottom, then the
stores and providers, then the Celery-free state machine, then the adapters that give it to
Celery, bulk sends, agent tools and operators.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "idemmail_celery"

LAYERS: dict[str, int] = {
    # 0: plumbing, vocabulary and settings
    "errors": 0, "_common": 0, "_ahead": 0, "_registry": 0, "config": 0, "metrics": 0, "redaction": 0,
    "sealing": 0, "_version": 0, "_memory": 0, "chain": 0, "diagnostics": 0, "encoding": 0,
    # 1: values: keys, messages
    "keys": 1, "email": 1,
    # 2: stores and providers, one module each behind one base class
    "ledger": 2, "providers": 2,
    # 3: the state machine and what it needs while a side effect runs
    "_lease": 3, "handler": 3, "roster": 3, "steps": 3, "rotation": 3, "recovery": 3, "batch": 3,
    # 4: the Celery adapter and its reports
    "outcomes": 4, "task": 4, "_request": 4, "republish": 4,
    # 5: what is built on the adapter
    "mail": 5, "bulk": 6, "tools": 6, "outbox": 5, "beat": 5, "webhooks": 5, "cli": 6, "testing": 5,
    "redrive": 5, "worker": 5,
    "__main__": 7, "__init__": 7,
    # integrations, each an optional extra: one row per module (a sub-package's rows go by its first two names)
    "contrib": 7, "contrib.mcp": 6, "contrib.langchain": 6, "contrib.django": 7,
}

#: Third-party packages only an optional extra brings: imported by their contrib module alone, never by the core.
OPTIONAL_IMPORTS = {"mcp": "contrib.mcp", "mcp_types": "contrib.mcp", "uvicorn": "contrib.mcp",
                    "anyio": "contrib.mcp", "langchain_core": "contrib.langchain", "langgraph": "contrib.langchain",
                    "django": "contrib.django"}


def layer_of(module: str) -> int:
    """``idemmail_celery.ledger.redis`` -> the layer of ``ledger``; ``...contrib.mcp`` -> that of ``contrib.mcp``."""
    parts = module.split(".")
    inner = parts[1:] if len(parts) > 1 and parts[0] == "idemmail_celery" else parts
    return LAYERS.get(".".join(inner[:2]), LAYERS[inner[0]])


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def imported(path: Path, name: str) -> list[str]:
    """The package modules ``path`` imports, anywhere in it (lazy imports too; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
                for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x
                    out += [f"{target}.{a.name}" for a in node.names]
                    continue
            else:
                target = node.module or ""
            if target.startswith("idemmail_celery"):
                out.append(target)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("idemmail_celery")]
    return out


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))  # KeyError names a module the table forgot


def test_nothing_imports_upward() -> None:
    upward = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        here = layer_of(name)
        for target in imported(path, name):
            if target == "idemmail_celery" or layer_of(target) > here:
                upward.append(f"{name} (layer {here}) imports {target}")
    assert upward == []


def test_optional_extras_are_imported_by_their_own_module_only() -> None:
    strays = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for target in targets:
                owner = OPTIONAL_IMPORTS.get(target.split(".")[0])
                if owner is not None and not (name + ".").startswith(f"idemmail_celery.{owner}."):  # or its package
                    strays.append(f"{name} imports {target}")
    assert strays == []


def test_importing_the_errors_registers_no_task_and_the_package_says_what_it_exports() -> None:
    import subprocess
    import sys

    code = (
        "from celery import Celery\n"
        "app = Celery('probe', set_as_current=False)\n"
        "import idemmail_celery.errors, idemmail_celery.ledger, idemmail_celery.handler\n"
        "import idemmail_celery\n"
        "app.finalize()\n"
        "print(sorted(n for n in app.tasks if n.startswith('idemmail')))\n"
        "from idemmail_celery import send_email, send_campaign\n"
        "later = Celery('later', set_as_current=False); later.finalize()\n"
        "print(sorted(n for n in later.tasks if n.startswith('idemmail')))\n"
        "print(sorted(idemmail_celery.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.splitlines()
    assert out[0] == "[]"  # nothing registered until send_email or send_campaign is imported
    assert out[1] == "['idemmail_celery.send_campaign', 'idemmail_celery.send_email']"
    exported = ast.literal_eval(out[2])
    assert "StaleTokenError" not in exported and "Settings" not in exported  # internal: from their modules
    assert {"IdempotentTask", "send_email", "send_campaign", "ledger_from_url", "provider_from_url",
            "PermanentSendError", "SendNeedsReview"} <= set(exported)


def test_every_error_is_defined_in_errors_py_and_drawn_in_its_tree() -> None:
    """One module holds the exception tree and its docstring draws it: a class added elsewhere, or
    added here and not drawn, fails."""
    import inspect

    from idemmail_celery import errors

    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "idemmail_celery":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # (OperatorError: the CLI's own carrier of an exit code, never raised to a caller.)
            if isinstance(node, ast.ClassDef) and node.name != "OperatorError" and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or hasattr(errors, b.id))
                    for b in node.bases):
                elsewhere.append(f"{path.relative_to(PACKAGE)}: class {node.name}")
    assert elsewhere == []

    def drawn(cls: type, depth: int) -> list[str]:
        also = [b.__name__ for b in cls.__bases__[1:] if b is not Exception]  # the first base is drawn above it
        line = "    " * (depth + 1) + cls.__name__ + (f" (also {', '.join(also)})" if also else "")
        children = [c for c in vars(errors).values()
                    if inspect.isclass(c) and c.__bases__[0] is cls and c.__module__ == errors.__name__]
        return [line] + [x for c in children for x in drawn(c, depth + 1)]

    tree = "\n".join(drawn(errors.IdemmailError, 0))
    assert tree in (errors.__doc__ or ""), tree
