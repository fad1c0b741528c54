"""askonce: one question key, one traveling retry budget, counted at the target.

Retries nest across layers and multiply (3 layers x 3 attempts = 27 arrivals for one question).
askonce makes every attempt carry the question's identity and a retry budget that is spent wherever
a retry happens, so a question costs at most ``1 + budget`` arrivals however deep the stack.

``import askonce`` is cheap: it imports no framework and not asyncio; integrations live in
``askonce.integrations.*`` and are imported only when used.
"""

from typing import TYPE_CHECKING

from askonce._context import current
from askonce._stats import stats
from askonce.core.backoff import Backoff
from askonce.core.bucket import BucketPolicy
from askonce.core.question import Question
from askonce.core.retry import RetryPolicy
from askonce.core.wire import Limits, Reply
from askonce.errors import (
    AskonceError,
    BudgetExhausted,
    CircuitOpen,
    DeadlineExceeded,
    DoNotRetry,
    GaveUp,
    RetryThrottled,
)
from askonce.propagation import fanout, outgoing, question, serve
from askonce.retrying import retry

if TYPE_CHECKING:
    from askonce.core.breaker import BreakerPolicy

__version__ = "0.1.0"

_LAZY = {"BreakerPolicy": "askonce.core.breaker"}


def __getattr__(name: str) -> object:
    """Names whose modules cost import time are imported on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'askonce' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "AskonceError",
    "Backoff",
    "BreakerPolicy",
    "BucketPolicy",
    "BudgetExhausted",
    "CircuitOpen",
    "DeadlineExceeded",
    "DoNotRetry",
    "GaveUp",
    "Limits",
    "Question",
    "Reply",
    "RetryPolicy",
    "RetryThrottled",
    "__version__",
    "current",
    "fanout",
    "outgoing",
    "question",
    "retry",
    "serve",
    "stats",
]
