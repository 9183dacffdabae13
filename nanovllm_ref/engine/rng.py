"""The engine's own random stream (chapter 08), kept apart from the user's.

The sampler draws its noise from the device's default generator: in eager code, inside the sampler that
torch.compile fuses (Inductor takes its seeds from the default generator, and an explicit
`generator=` argument would make it fall back to an unfused kernel), and inside a captured CUDA graph
(the default CUDA generator is registered with every graph at capture, and each replay reads its seed and
offset then). So instead of passing a torch.Generator down, the engine owns a generator *state* and swaps
it into the default generator of its device only while it runs (`with rng.active():`), then swaps the
user's state back:
- creating an engine does not reseed anything the user sees (before, `torch.manual_seed(seed)` did);
- the user's own draws between steps do not change the engine's samples, and the engine's draws do not
  move the user's stream;
- the same `seed` gives the same samples for the same requests batched the same way.
Samples still depend on the batch (which rows share a step); per-request seeds (SamplingParams.seed) will
fix that. The swap is a few microseconds per step and no device sync (a CUDA generator's state is its seed
and offset, held on the host). It is per process, not per thread: another thread drawing from the same
device's default generator during a step would interleave with the engine.
"""
import contextlib

import torch


class EngineRNG:
    """The random state of one engine on `device` (a torch.device), seeded with `seed` (an int >= 0)."""

    def __init__(self, seed: int, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            with torch.random.fork_rng(devices=[self.device]), torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)            # fork_rng puts the device's old state back
                self.state = torch.cuda.get_rng_state(self.device)
        else:
            self.state = torch.Generator().manual_seed(seed).get_state()
        self._depth = 0             # active() blocks open (start-up steps run inside start-up's block)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def active(self):
        """Inside the block the device's default generator runs the engine's stream; on exit (also on an
        exception) the engine's state is saved and the caller's state is back. Re-entrant: an inner block
        (a warm-up step inside start-up) changes nothing."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        saved = self._get()
        self._set(self.state)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self.state = self._get()
            self._set(saved)
