"""askonce: one question key, one traveling retry budget, counted at the target.

Retries nest across layers and multiply (3 layers x 3 attempts = 27 arrivals for one question).
askonce makes every attempt carry the question's identity and a retry budget that is spent wherever
a retry happens, so a question costs at most ``1 + budget`` arrivals however deep the stack.

``import askonce`` is cheap: it imports no framework and not asyncio; integrations live in
``askonce.integrations.*`` and are imported only when used.
"""

from typing import TYPE_CHECKING

from askonce.context import (
    bind,
    current,
    extract,
    extract_reply,
    fanout,
    inject,
    new_key,
    outgoing,
    question,
    serve,
    stats,
)
from askonce.core.backoff import NO_WAIT, Backoff
from askonce.core.bucket import BucketPolicy
from askonce.core.question import Hop, Question
from askonce.core.retry import Failure, RetryPolicy
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Limits, Reply
from askonce.errors import (
    AskonceError,
    BudgetExhausted,
    CircuitOpen,
    DeadlineExceeded,
    DoNotRetry,
    GaveUp,
    MalformedContext,
    RetryThrottled,
)
from askonce.retrying import retry

if TYPE_CHECKING:
    from askonce.breakers import BreakerRegistry
    from askonce.core.breaker import BreakerPolicy

__version__ = "0.1.0"

_LAZY = {"BreakerPolicy": "askonce.core.breaker", "BreakerRegistry": "askonce.breakers"}


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
    "NO_WAIT",
    "QUESTION_HEADER",
    "REPLY_HEADER",
    "AskonceError",
    "Backoff",
    "BreakerPolicy",
    "BreakerRegistry",
    "BucketPolicy",
    "BudgetExhausted",
    "CircuitOpen",
    "DeadlineExceeded",
    "DoNotRetry",
    "Failure",
    "GaveUp",
    "Hop",
    "Limits",
    "MalformedContext",
    "Question",
    "Reply",
    "RetryPolicy",
    "RetryThrottled",
    "__version__",
    "bind",
    "current",
    "extract",
    "extract_reply",
    "fanout",
    "inject",
    "new_key",
    "outgoing",
    "question",
    "retry",
    "serve",
    "stats",
]
