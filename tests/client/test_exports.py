"""The public API is what __all__ says, nothing more: adding or removing a name is a decision."""

import askonce

EXPECTED = {
    'AskonceError', 'Backoff', 'BreakerPolicy', 'BreakerRegistry', 'BucketPolicy', 'BudgetExhausted',
    'CircuitOpen', 'DeadlineExceeded', 'DoNotRetry', 'Failure', 'GaveUp', 'Hop', 'Limits', 'MalformedContext',
    'NO_WAIT', 'QUESTION_HEADER', 'Question', 'REPLY_HEADER', 'Reply', 'RetryPolicy', 'RetryThrottled',
    '__version__', 'bind', 'current', 'extract', 'extract_reply', 'fanout', 'inject', 'new_key', 'outgoing',
    'question', 'retry', 'serve', 'stats',
}


def test_all_is_pinned() -> None:
    assert set(askonce.__all__) == EXPECTED


def test_every_exported_name_exists_and_is_documented() -> None:
    for name in askonce.__all__:
        obj = getattr(askonce, name)
        if callable(obj) and not isinstance(obj, type(askonce.NO_WAIT)):
            assert obj.__doc__, f"askonce.{name} has no docstring"
