"""docs/architecture.md's map of the layers ("The layers") names every module of lingbot/ and deployments/, each in
its package, and nothing that is not there: a module added, moved or renamed fails here until the map follows."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mapped_modules(text: str) -> set[str]:
    """The .py paths the map's code block names, each under the folders it is indented beneath (two spaces a
    level: `lingbot/`, then `  runtime/`, then `    kv_cache.py` is lingbot/runtime/kv_cache.py)."""
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    named, folders = set(), []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0] if line.strip() else ""
        if indent % 2 or not name.endswith(("/", ".py")):
            continue                                 # a continued description, or a blank line
        folders[indent // 2:] = [name]
        if name.endswith(".py"):
            named.add("".join(folders))
    return named


def test_the_layers_map_names_every_module_and_only_those():
    listed = subprocess.run(["git", "ls-files", "lingbot", "deployments"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    modules = {f for f in listed if f.endswith(".py") and not f.endswith(("/__init__.py", "/__main__.py"))}
    named = mapped_modules((ROOT / "docs" / "architecture.md").read_text())
    assert sorted(modules - named) == [], "modules missing from docs/architecture.md's layers map"
    assert sorted(named - modules) == [], "the layers map names modules that are not there"


def test_the_map_reader_follows_indentation():
    text = ("## The layers\n\n```\nlingbot/  the engine\n  io/   media\n    video.py  H.264\n"
            "                 continued\n  cli.py  the command\n```\n")
    assert mapped_modules(text) == {"lingbot/io/video.py", "lingbot/cli.py"}
