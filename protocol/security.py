"""CURVE authentication for TCP endpoints: only peers whose public key is in the allowed directory
get through; everyone else's connection is dropped by ZeroMQ before a byte reaches tether.

Keys come from `tether keys DIR NAME` (a ``NAME.key`` / ``NAME.key_secret`` pair). The buffer (and
the learner's weight server) hold ``transport.curve.server_key``; every role holds its own
``client_key`` and the server's public key; ``allowed_clients`` is a directory of public keys.
"""

from __future__ import annotations

import os
import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """Write ``name.key`` (public, to hand out) and ``name.key_secret`` (private, 0600)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def _load(path: str, key: str) -> tuple[bytes, bytes | None]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"transport.curve.{key}: {path} does not exist (make one with `tether keys`)")
    return zmq.auth.load_certificate(path)


def secure_server(socket: zmq.Socket, curve) -> None:
    """Make ``socket`` a CURVE server that admits only the allowed client keys."""
    if curve is None or not curve.enabled:
        return
    public, secret = _load(curve.server_key, "server_key")
    if secret is None:
        raise ValueError(f"transport.curve.server_key: {curve.server_key} holds no secret key (use the .key_secret file)")
    if not os.path.isdir(curve.allowed_clients):
        raise FileNotFoundError(f"transport.curve.allowed_clients: {curve.allowed_clients} is not a directory")
    with _lock:  # one authenticator per context; it answers ZAP for every CURVE socket of it
        context = socket.context
        if id(context) not in _authenticators:
            authenticator = ThreadAuthenticator(context)
            authenticator.start()
            authenticator.configure_curve(domain="*", location=curve.allowed_clients)
            _authenticators[id(context)] = authenticator
    socket.curve_secretkey, socket.curve_publickey, socket.curve_server = secret, public, True


def secure_client(socket: zmq.Socket, curve) -> None:
    """Make ``socket`` a CURVE client that proves its own key and checks the server's."""
    if curve is None or not curve.enabled:
        return
    public, secret = _load(curve.client_key, "client_key")
    if secret is None:
        raise ValueError(f"transport.curve.client_key: {curve.client_key} holds no secret key (use the .key_secret file)")
    server_public, _ = _load(curve.server_public_key, "server_public_key")
    socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = secret, public, server_public
