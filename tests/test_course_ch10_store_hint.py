"""E10.3's host-read hint (nanovllm_course/ch10.py, check_capture_safe_store): each wrong store reaches the
hint for its own mistake.

- indexing with a 0-d tensor (`slots[first]`, first = argmax()) is a host read PyTorch does without any
  `.item()` in the code: the check names that trap and the fix (index_select with a 1-element index);
- an explicit `.item()` gets the general hint, which lists the host reads, the 0-d index among them, and no
  longer suggests `clamp` (which the spec calls a trap: it sends padding rows to slot 0).
"""
import pytest
import torch

from nanovllm_course import ch10


def store_indexing_with_0d(key, value, k_cache, v_cache, slot_mapping):
    """The reference's idea, but picks the first real row with x[t] for a 0-d t."""
    slots = slot_mapping.long()
    real = slots >= 0
    first = real.long().argmax()                       # 0-d
    anchor = torch.where(real[first], slots[first], 0)  # x[t] with a 0-d t: a host read
    target = torch.where(real, slots, anchor)
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        rows = torch.where(real[:, None, None], src, src[first].unsqueeze(0))
        flat.index_copy_(0, target, rows)


def store_with_item(key, value, k_cache, v_cache, slot_mapping):
    if int((slot_mapping >= 0).sum().item()) == 0:
        return
    ch10.reference_store_kvcache(key, value, k_cache, v_cache, slot_mapping)


@pytest.mark.parametrize("run", range(3))
def test_indexing_with_a_0d_tensor_gets_its_own_hint(run):
    with pytest.raises(AssertionError) as info:
        ch10.check_capture_safe_store(store_indexing_with_0d)
    text = str(info.value)
    assert text.startswith("E10.3: your store indexes a tensor with a 0-d tensor (x[t] where t is"), text
    assert "x.index_select(0, t.view(1))" in text and "clamp" not in text


@pytest.mark.parametrize("run", range(3))
def test_an_item_call_gets_the_general_hint_without_clamp(run):
    with pytest.raises(AssertionError) as info:
        ch10.check_capture_safe_store(store_with_item)
    text = str(info.value)
    assert text.startswith("E10.3: your store runs aten._local_scalar_dense"), text
    assert "x[t] with a 0-d tensor t" in text and "clamp" not in text.split("hint:")[1]


def test_the_reference_store_still_passes(capsys):
    ch10.check_capture_safe_store(ch10.reference_store_kvcache)
    assert capsys.readouterr().out == "E10.3 ok\n"
