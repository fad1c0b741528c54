"""Frozen, slotted value classes that behave as ``@dataclass(frozen=True, slots=True)`` ones do.

``import dataclasses`` imports ``inspect`` (with ``ast``, ``dis`` and ``tokenize``) and every
dataclass writes and compiles its methods when its module is imported: together most of what
``import askonce`` cost. A :class:`Record` subclass instead names its fields once, in
``__slots__ = __match_args__ = (...)`` (with an annotation each), and writes its own ``__init__``,
setting each field with ``object.__setattr__`` and then validating. The base gives it the rest:
``repr``, equality and hash over the fields in order (written for the class on first use, as a
dataclass writes them at import), ``FrozenInstanceError`` on assignment and
deletion, pickling and copying (the same pickles as the dataclass's), ``__replace__`` and, made on
first use by the ``dataclasses`` module the caller has imported, ``__dataclass_fields__`` and
``__dataclass_params__``, so ``dataclasses.fields``, ``replace``, ``asdict`` and ``is_dataclass``
work as on a dataclass. Type checkers see frozen dataclasses (``dataclass_transform``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, dataclass_transform

if TYPE_CHECKING:
    from dataclasses import Field


def _frozen(message: str) -> NoReturn:
    from dataclasses import FrozenInstanceError  # only a mistake pays for the import

    raise FrozenInstanceError(message)


def _dataclass_of(cls: type) -> type:
    """A dataclass with ``cls``'s fields, annotations and defaults, for its ``Field`` objects."""
    import dataclasses

    fields: tuple[str, ...] = cls.__match_args__  # type: ignore[attr-defined]
    init = getattr(cls, "__init__")  # noqa: B009 (the class's own, not an instance's)
    code = init.__code__
    params = code.co_varnames[1:code.co_argcount]
    if params != fields or code.co_kwonlyargcount:
        raise TypeError(f"{cls.__qualname__}.__init__ must take the fields {fields} in order")
    defaults = init.__defaults__ or ()
    namespace: dict[str, Any] = dict(zip(fields[len(fields) - len(defaults):], defaults,
                                              strict=True))
    namespace["__annotations__"] = {name: cls.__annotations__[name] for name in fields}
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    return dataclasses.dataclass(frozen=True)(type(cls.__name__, (), namespace))


def _written(cls: type, name: str) -> Callable[..., Any]:
    """``cls``'s own ``__repr__``, ``__eq__`` or ``__hash__``, written from its fields, compiled and
    set on the class, so that the next call goes straight to it."""
    fields: tuple[str, ...] = cls.__match_args__  # type: ignore[attr-defined]
    mine = "".join(f"self.{field}," for field in fields)
    theirs = "".join(f"other.{field}," for field in fields)
    shown = ", ".join(f"{field}={{self.{field}!r}}" for field in fields)
    source = {
        "__repr__": f"def __repr__(self):\n return f'{{type(self).__qualname__}}({shown})'",
        "__eq__": ("def __eq__(self, other):\n if other.__class__ is self.__class__:\n"
                   f"  return ({mine}) == ({theirs})\n return NotImplemented"),
        "__hash__": f"def __hash__(self):\n return hash(({mine}))",
    }[name]
    namespace: dict[str, Any] = {}
    exec(source, {}, namespace)  # fields are identifiers: __match_args__ are slot names
    method = namespace[name]
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    type.__setattr__(cls, name, method)
    return method  # type: ignore[no-any-return]


class _Made:
    """A class attribute made by ``dataclasses`` on first read, then stored on the class."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, cls: type) -> Any:
        if cls is Record:
            raise AttributeError(self.name)  # the base itself is no dataclass
        shadow = _dataclass_of(cls)
        for name in ("__dataclass_fields__", "__dataclass_params__"):
            type.__setattr__(cls, name, getattr(shadow, name))
        return getattr(shadow, self.name)


@dataclass_transform(frozen_default=True)
class Record:
    """The base of askonce's frozen value classes (policies, ``Reply``, ``Question``)."""

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()
    if TYPE_CHECKING:
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    else:
        __dataclass_fields__ = _Made("__dataclass_fields__")
        __dataclass_params__ = _Made("__dataclass_params__")

    # repr, == and hash are written for each class on first use, as a dataclass writes them at
    # import: reading the fields by name is what makes them as fast as a dataclass's.

    def __repr__(self) -> str:
        return _written(type(self), "__repr__")(self)  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        return _written(type(self), "__eq__")(self, other)  # type: ignore[no-any-return]

    def __hash__(self) -> int:
        return _written(type(self), "__hash__")(self)  # type: ignore[no-any-return]

    if not TYPE_CHECKING:  # seen, a __setattr__ would let type checkers accept any attribute

        def __setattr__(self, name: str, value: object) -> NoReturn:
            _frozen(f"cannot assign to field {name!r}")

        def __delattr__(self, name: str) -> NoReturn:
            _frozen(f"cannot delete field {name!r}")

    def __getstate__(self) -> list[Any]:
        # by __match_args__, which a dataclass extending a record sets to all its fields
        return [getattr(self, name) for name in self.__match_args__]

    def __setstate__(self, state: list[Any]) -> None:
        for name, value in zip(self.__match_args__, state, strict=False):  # as dataclasses does
            object.__setattr__(self, name, value)

    def __replace__(self, **changes: Any) -> Any:
        """``copy.replace`` (Python 3.13): a copy with ``changes``, validated anew."""
        for name in self.__match_args__:
            if name not in changes:
                changes[name] = getattr(self, name)
        return type(self)(**changes)
