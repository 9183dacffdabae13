"""Load a safetensors checkpoint into our (fused, tensor-parallel) model (chapter 03).

Checkpoint names follow HF (`model.layers.0.self_attn.q_proj.weight`). Where our model fuses several
checkpoint tensors into one parameter (`qkv_proj`, `gate_up_proj`), the model's `packed_modules_mapping`
gives the fused name and the shard id, and the parameter's `weight_loader` copies the tensor (this rank's
slice of it) into place. Upstream nano-vllm `utils/loader.py`.

Which files: as HF transformers. If `model.safetensors.index.json` exists, exactly the shards its
`weight_map` lists (other *.safetensors files in the folder, e.g. a leftover or a consolidated copy, are
not read); else `model.safetensors`; else the folder's only *.safetensors file.

Tied embeddings (`tie_word_embeddings`): the LM head is the embedding, unless the checkpoint also stores an
`lm_head.weight` with different values; then, as current HF does, the stored head is kept (untied).

Raises ValueError if no checkpoint file is found, the index is unreadable or lists a missing shard, two
files define the same tensor, several *.safetensors files exist with neither index nor model.safetensors,
or a parameter of the model is never loaded.
"""
import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files that make up the checkpoint in folder `path` (see the module docstring)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cannot read the shard list (weight_map) of {index!r}: {exc!r}") from exc
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise ValueError(f"{index!r} lists shard(s) that are not in the folder: {missing[:5]}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file in {path!r}")
    if len(files) > 1:
        raise ValueError(f"{path!r} holds several .safetensors files {[os.path.basename(f) for f in files][:5]} "
                         f"but no {INDEX_FILE} saying which make up the checkpoint; add the index or keep one file")
    return files


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
    if loaded_weight.shape != param.shape:
        raise RuntimeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Copy the checkpoint in folder `path` into `model`'s parameters (this rank's slices). Raises ValueError."""
    files = checkpoint_files(path)
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded, source, stored_head = set(), {}, None
    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as exc:                  # a truncated or foreign file
            raise ValueError(f"cannot read safetensors file {file!r}: {exc}") from exc
        with handle as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name in source:
                    raise ValueError(f"checkpoint tensor {name!r} is defined twice, in {source[name]!r} and "
                                     f"{os.path.basename(file)!r}")
                source[name] = os.path.basename(file)
                if name == "lm_head.weight" and tied:
                    stored_head = f.get_tensor(name)     # compared with the embedding once that is loaded
                    continue
                target, shard_id = name, None
                for ckpt_part, (fused_part, sid) in mapping.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(f".{ckpt_part}.", f".{fused_part}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(name).to(param.dtype)
                try:
                    if shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except NotImplementedError:       # a course exercise's stub loader: let it say so
                    raise
                except RuntimeError as exc:       # shape mismatch: config.json and weights disagree
                    raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not fit "
                                     f"parameter {target!r} of shape {tuple(param.shape)} (does config.json "
                                     f"match the weights?): {exc}") from exc
                loaded.add(target)
    if stored_head is not None:
        _untie_if_different(model, stored_head)
    missing = [n for n in params if n not in loaded
               and not (n == "lm_head.weight" and tied)]
    if missing:
        raise ValueError(f"checkpoint in {path!r} lacks weights for: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")


def _untie_if_different(model: nn.Module, stored_head: torch.Tensor) -> None:
    """Tied model, checkpoint with its own lm_head.weight: keep it as a separate head if it differs."""
    head = model.lm_head
    weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)
    try:
        head.weight_loader(weight, stored_head.to(weight.dtype))
    except RuntimeError as exc:
        raise ValueError(f"checkpoint tensor 'lm_head.weight' of shape {tuple(stored_head.shape)} does not fit "
                         f"the LM head: {exc}") from exc
    if not torch.equal(weight, head.weight):
        head.weight = weight                      # a parameter of its own: untied
        model.tie_word_embeddings = False
