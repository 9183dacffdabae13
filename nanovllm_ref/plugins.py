"""Commands and model names that other installed packages add to `python -m nanovllm_ref`.

The engine imports nothing from the benchmark or the checkpoint tooling (no arrow points from the engine to
them). Instead those packages register themselves as entry points of the installed distribution
(pyproject.toml, `[project.entry-points."..."]`), and the command line finds them here through
`importlib.metadata`:

- group `nanovllm_ref.commands`: name -> `main(argv: list[str]) -> int`, run as
  `python -m nanovllm_ref NAME ARGS...` (this project registers `bench` and `download`);
- group `nanovllm_ref.models`: name -> `locate(download: bool = True) -> str | None`, the folder of a named
  model, fetched on first use when `download` is true, None when it is absent and `download` is false
  (this project registers `smollm2`).

Entry points exist only for an installed distribution (`pip install -e .` writes them); a checkout used
through PYTHONPATH alone has none, and the messages below say so.
"""
from importlib.metadata import EntryPoint, entry_points

COMMANDS = "nanovllm_ref.commands"
MODELS = "nanovllm_ref.models"
_NOT_INSTALLED = ("entry points exist only once the distribution is installed (pip install -e . in the "
                  "checkout)")


def registered(group: str) -> dict[str, EntryPoint]:
    """The entry points of `group` by name (a later duplicate wins)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def run_command(name: str, argv: list[str]) -> int:
    """Run the registered command `name` with `argv`; returns its exit status (None counts as 0).
    Raises ValueError naming the registered commands when `name` is not one of them."""
    commands = registered(COMMANDS)
    if name not in commands:
        raise ValueError(f"no command {name!r} is registered (group {COMMANDS}: {sorted(commands) or 'none'}); "
                         f"{_NOT_INSTALLED}")
    status = commands[name].load()(list(argv))
    return 0 if status is None else int(status)


def model_path(name_or_path: str, download: bool = True) -> str | None:
    """The folder for a registered model name (fetched first when `download`), or `name_or_path` itself when
    it is no registered name (a folder path). None: a registered model that is absent and download=False."""
    models = registered(MODELS)
    if name_or_path not in models:
        return name_or_path
    found = models[name_or_path].load()(download=download)
    return None if found is None else str(found)
