"""The API: Flask under waitress, calling the service with requests (threads, blocking I/O).

``python -m askonce.demo.layer_wsgi``. ``GET /q`` calls the service's ``GET /q``: in naive mode
through the plain retry loop, forwarding ``x-question-id``; in askonce mode through
:class:`~askonce.integrations.requests.AskonceAdapter` under
:class:`~askonce.integrations.wsgi.AskonceWSGIMiddleware`. Control endpoints as the ASGI layers'.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

import requests
from flask import Flask
from flask import request as flask_request
from requests.adapters import HTTPAdapter

import askonce
from askonce.client import ClientPolicy
from askonce.core.backoff import Backoff
from askonce.core.retry import RetryPolicy
from askonce.demo import child, naive
from askonce.demo.params import DEMO_BREAKER, LayerSettings, from_json
from askonce.errors import reply_of
from askonce.integrations.requests import session as askonce_session
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from askonce.integrations.wsgi_join import JoinWSGIMiddleware

NAME = "api"
THREADS = 128  # a small pool would make this layer, not the target, the bottleneck under retries
POOL = 256

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


class Api:
    def __init__(self) -> None:
        self.settings = LayerSettings()
        self.session = self._plain_session()
        self.rng = random.Random(1)
        self.lock = threading.Lock()
        self.inflight = 0
        self.flask = Flask("askonce-demo-api")
        self.flask.add_url_rule("/q", "q", self.handle)
        self.askonce_app = self._askonce(join=True)

    def _askonce(self, join: bool) -> AskonceWSGIMiddleware:
        """The app under askonce: a fresh join table each run."""
        # Background runs (async mode) up to the threads waitress has: the api's own bound.
        inner: Any = (JoinWSGIMiddleware(self.flask.wsgi_app, max_background=THREADS) if join
                      else self.flask.wsgi_app)
        return AskonceWSGIMiddleware(inner, layer=NAME)

    @staticmethod
    def _plain_session() -> requests.Session:
        s = requests.Session()
        s.trust_env = False  # no proxy or netrc look-ups on every call: this is loopback
        s.mount("http://", HTTPAdapter(pool_connections=4, pool_maxsize=POOL, max_retries=0))
        return s

    def configure(self, settings: LayerSettings) -> None:
        old = self.session
        if settings.mode == "askonce":
            store: Any = None
            if settings.redis is not None:
                from askonce.stores.redis import RedisStore

                store = RedisStore(settings.redis, prefix=f"{settings.prefix}:{NAME}")
            else:
                from askonce import _stats
                from askonce.stores.memory import MemoryStore

                store = MemoryStore(_stats.monotonic)
            policy = ClientPolicy(
                layer=NAME,
                retry=RetryPolicy(attempts=settings.attempts,
                                  backoff=Backoff(base=settings.backoff_base,
                                                  cap=max(settings.backoff_cap,
                                                          settings.backoff_base))),
                attempt_timeout=settings.timeout, deadline_grace=settings.grace,
                breaker=DEMO_BREAKER if settings.breaker else None,
                respond_async=settings.respond_async,
            )  # fmt: skip
            self.session = askonce_session(policy, store=store, pool_connections=4,
                                           pool_maxsize=POOL)
            self.askonce_app = self._askonce(settings.join)
            self.session.trust_env = False
        else:
            self.session = self._plain_session()
        self.settings = settings
        self.rng = random.Random(f"{settings.seed}:{NAME}")
        old.close()

    def handle(self) -> tuple[bytes, int]:
        s, session = self.settings, self.session
        url = s.downstream + "/q"
        with self.lock:
            self.inflight += 1
        try:
            if s.mode == "naive":
                headers = {"x-question-id": flask_request.headers.get("x-question-id", "")}
                status = naive.get_sync(session, url, headers, attempts=s.attempts,
                                        timeout=s.timeout, base=s.backoff_base, cap=s.backoff_cap,
                                        rng=self.rng)
                return (b"ok\n" if status == 200 else b"failed\n"), status
            try:
                # Each try is limited by the policy's attempt_timeout (not toward a callee
                # that joins: this layer then waits for it) and the question's deadline.
                response = session.get(url)
            except Exception as exc:
                if reply_of(exc) is None:
                    raise
                # A give-up the client recorded (askonce.client.last_reply): the middleware passes
                # its do-not-retry on in the reply to this error answer.
                return b"failed\n", 503
            response.close()
            if response.status_code >= 500:  # a returned give-up was recorded too (last_reply)
                return b"failed\n", response.status_code
            return b"ok\n", response.status_code
        finally:
            with self.lock:
                self.inflight -= 1

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = str(environ.get("PATH_INFO", ""))
        if path.startswith("/_demo/"):
            return self.control(path, environ, start_response)
        if self.settings.mode == "askonce":
            return self.askonce_app(environ, start_response)
        return self.flask.wsgi_app(environ, start_response)

    def control(self, path: str, environ: Environ,
                start_response: StartResponse) -> Iterable[bytes]:
        status, body = "200 OK", {"ok": True}  # type: tuple[str, dict[str, Any]]
        if path == "/_demo/config":
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
                self.configure(from_json(LayerSettings,
                                         json.loads(environ["wsgi.input"].read(length))))
            except (ValueError, TypeError) as exc:
                status, body = "400 Bad Request", {"error": str(exc)}
        elif path == "/_demo/stats":
            body = {"inflight": self.inflight, "mode": self.settings.mode,
                    "counters": askonce.stats()}
        elif path != "/_demo/health":
            status, body = "404 Not Found", {"error": "no such control"}
        data = json.dumps(body).encode()
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(data)))])
        return [data]


def main() -> None:
    child.prepare()
    child.serve_wsgi(Api(), threads=THREADS)


if __name__ == "__main__":
    main()
