"""The rooms' layer order (docs/architecture.md) and no import cycle, read from the source: every
`dr_scale` import, at the top of a module or inside a function, goes to the same or a lower layer,
and following imports from any module never comes back to it."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dr_scale"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layers() -> dict:
    """{room: layer number} from the numbered list under "## Layer order"."""
    text = ARCHITECTURE.read_text().split("## Layer order", 1)[1]
    rooms = {}
    for number, line in re.findall(r"^(\d+)\. (.+)$", text, flags=re.M):
        for room in re.findall(r"`([\w.]+)`", line):
            rooms[room] = int(number)
    return rooms


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found.update({"dr_scale.kernels" + module_name(p)[len("kernels"):]: p
                  for p in (ROOT / "kernels").rglob("*.py")})  # installed as dr_scale.kernels
    return found


def imports(name: str, path: Path, known) -> set:
    """The dr_scale modules `name` imports (a package's attribute imported as a module counts
    as that module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.startswith("dr_scale") and t in known and t != name}
    return out


def room(name: str, rooms: dict) -> str:
    """The longest room name that `name` lies in (dr_scale.train.trainer -> train)."""
    parts = name.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rooms:
            return ".".join(parts[:n])
    raise AssertionError(f"{name}: in no room of docs/architecture.md's layer order")


def test_every_import_goes_to_the_same_or_a_lower_layer():
    rooms, known = layers(), modules()
    against = []
    for name, path in sorted(known.items()):
        if name == "dr_scale":
            continue
        mine = rooms[room(name, rooms)]
        for target in sorted(imports(name, path, known)):
            if target == "dr_scale":
                continue
            if rooms[room(target, rooms)] > mine:
                against.append(f"{name} (layer {mine}) imports {target} "
                               f"(layer {rooms[room(target, rooms)]})")
    assert not against, "\n".join(against)


def test_no_import_cycle():
    known = modules()
    graph = {n: imports(n, p, known) for n, p in known.items()}
    # a package's __init__ re-exporting its modules is not a cycle of rooms: leave it out
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state, cycles = {}, []

    def visit(n, trail):
        state[n] = "open"
        for t in sorted(graph.get(n, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(trail[trail.index(t):] + [t]))
            elif t not in state:
                visit(t, trail + [t])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_checkpoints_are_reached_through_their_own_package():
    """The side jobs (cli) and export read checkpoints through dr_scale.checkpoint; the training
    loop's package is no library of theirs."""
    known = modules()
    reaching = [f"{name} imports {target}" for name, path in sorted(known.items())
                if name == "dr_scale.cli" or name.startswith("dr_scale.export")
                for target in sorted(imports(name, path, known))
                if target.startswith("dr_scale.train")]
    assert not reaching, "\n".join(reaching)
    assert any(t.startswith("dr_scale.checkpoint") for t in imports(
        "dr_scale.cli", known["dr_scale.cli"], known))
