"""Load a safetensors checkpoint into our (fused, tensor-parallel) model (chapter 03).

Checkpoint names follow HF (`model.layers.0.self_attn.q_proj.weight`). Where our model fuses several
checkpoint tensors into one parameter (`qkv_proj`, `gate_up_proj`), the model's `packed_modules_mapping`
gives the fused name and the shard id, and the parameter's `weight_loader` copies the tensor (this rank's
slice of it) into place. Upstream nano-vllm `utils/loader.py`.

Raises ValueError if the folder has no .safetensors file, or if a parameter of the model is never loaded.
"""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
    if loaded_weight.shape != param.shape:
        raise RuntimeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file in {path!r}")
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as exc:                  # a truncated or foreign file
            raise ValueError(f"cannot read safetensors file {file!r}: {exc}") from exc
        with handle as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard_id = name, None
                for ckpt_part, (fused_part, sid) in mapping.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(f".{ckpt_part}.", f".{fused_part}."), sid
                        break
                param = params.get(target)
                if param is None:
                    if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                        continue        # tied: the embedding already is the head
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
    missing = [n for n in params if n not in loaded
               and not (n == "lm_head.weight" and getattr(model, "tie_word_embeddings", False))]
    if missing:
        raise ValueError(f"checkpoint in {path!r} lacks weights for: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
