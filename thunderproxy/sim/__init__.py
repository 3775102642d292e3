"""thunderproxy sim: a simulated vLLM (or SGLang) backend that runs on a couple of CPU cores.

Rooms, from the data up:
- config.py: ``SimConfig``, the profiles and knobs, read by both rooms;
- engine/: the engine without HTTP (blocks, scheduler, offload tier, timing, tokenizer, metrics,
  ground truth) and its trio step loop (``engine/core.py``);
- api/: the HTTP faces over it (vLLM/OpenAI, Anthropic, Responses, SGLang, control, Prometheus)
  assembled into one raw-ASGI app (``api/app.py``);
- server.py: the app on hypercorn's trio worker (``Simulator``, ``open_simulator``);
- cli.py (``thunderproxy sim``), loadtest.py, calibrate.py: entry points.
"""

from .config import PROFILES, SimConfig, TimingProfile
from .engine import truth
from .engine.core import Engine, EngineDeadError, QueueFullError, RequestHandle, StepOutput
from .server import Simulator, open_simulator, serve_simulator

__all__ = [
    "PROFILES",
    "Engine",
    "EngineDeadError",
    "QueueFullError",
    "RequestHandle",
    "SimConfig",
    "Simulator",
    "StepOutput",
    "TimingProfile",
    "open_simulator",
    "serve_simulator",
    "truth",
]
