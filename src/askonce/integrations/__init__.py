"""Framework integrations, one module each, imported only when used: ``import askonce`` loads none.

Clients: ``askonce.integrations.httpx`` (``AskonceTransport``, ``AsyncAskonceTransport``) and
``askonce.integrations.requests`` (``AskonceAdapter``, ``session``), both over
:mod:`askonce.client`.
Servers: ``askonce.integrations.asgi`` and ``askonce.integrations.wsgi``, over
``integrations._server``; gRPC: ``askonce.integrations.grpc`` (``AskonceClientInterceptor``,
``AsyncAskonceClientInterceptor``, ``AskonceServerInterceptor``, ``AsyncAskonceServerInterceptor``,
``channel_options``); joins at a gRPC server: ``askonce.integrations.grpc_join``.
OpenTelemetry: ``askonce.integrations.otel``; Prometheus: ``askonce.integrations.prometheus``.
Each needs its extra: ``pip install 'askonce[httpx]'``, ``[requests]``, ``[asgi]``, ...
"""
