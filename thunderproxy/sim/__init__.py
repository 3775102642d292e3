"""thunderproxy sim: a simulated vLLM (or SGLang) backend that runs on a couple of CPU cores.

Layers, from the data up:
- tokenizer.py, blocks.py, scheduler.py, timing.py: pure engine logic (no trio, no HTTP);
- engine.py: the trio step loop, reading time only through `trio.current_time()`;
- protocol.py, responses.py, exposition.py, truth.py: wire formats, pure functions;
- tools.py (tool calls, the template's tool parts), chat_tools.py, anthropic.py,
  responses_api.py, serving.py: tool calls and the Anthropic and Responses APIs;
- app.py, sglang.py, server.py: the raw-ASGI app on hypercorn's trio worker;
- cli.py (`thunderproxy sim`), loadtest.py, calibrate.py: entry points.
"""

from .config import PROFILES, SimConfig, TimingProfile
from .engine import Engine, EngineDeadError, QueueFullError, RequestHandle, StepOutput
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
]
