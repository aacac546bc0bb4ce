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
from zmq.utils import z85
from zmq.auth.thread import ThreadAuthenticator

_authenticators: dict[int, tuple[ThreadAuthenticator, dict[bytes, str]]] = {}
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
            names: dict[bytes, str] = {}
            # each message then carries its key's name as ZeroMQ's User-Id: who is speaking, proven
            authenticator.curve_user_id = lambda public: names.get(z85.encode(public), "")
            authenticator.start()
            _authenticators[id(context)] = (authenticator, names)
        # a context has one ZAP handler: a later server (another run in the same process) sets the keys
        authenticator, names = _authenticators[id(context)]
        authenticator.configure_curve(domain="*", location=curve.allowed_clients)
        names.clear()
        names.update(key_names(curve.allowed_clients))
    socket.curve_secretkey, socket.curve_publickey, socket.curve_server = secret, public, True


def key_names(directory: str) -> dict[bytes, str]:
    """z85 public key -> the name of its file (``rollout-0.key`` -> ``rollout-0``) in ``directory``."""
    names = {}
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".key"):
            public, _ = zmq.auth.load_certificate(os.path.join(directory, entry))
            names[public] = entry[:-len(".key")]
    return names


def role_of_key(name: str, roles: tuple[str, ...]) -> str | None:
    """The role a client key is bound to, by its name: ``rollout``, ``rollout-0``, ``scorer-gpu3``
    ... (the role, then ``-`` and anything); None for a name that starts with no role."""
    for role in roles:
        if name == role or name.startswith(role + "-"):
            return role
    return None


def worker_of_key(name: str, roles: tuple[str, ...]) -> str | None:
    """The one worker a key names, ``rollout-0`` -> ``rollout:0`` (its role, ``-`` and a number);
    None where the name says no number (``learner``, ``scorer-gpu3``: the first worker it says
    hello as is its one)."""
    role = role_of_key(name, roles)
    index = name[len(role) + 1:] if role is not None else ""
    return f"{role}:{index}" if index.isdigit() else None


def message_key(frame: zmq.Frame) -> str:
    """The name of the CURVE key a received frame came with; "" without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


def secure_client(socket: zmq.Socket, curve) -> None:
    """Make ``socket`` a CURVE client that proves its own key and checks the server's."""
    if curve is None or not curve.enabled:
        return
    public, secret = _load(curve.client_key, "client_key")
    if secret is None:
        raise ValueError(f"transport.curve.client_key: {curve.client_key} holds no secret key (use the .key_secret file)")
    server_public, _ = _load(curve.server_public_key, "server_public_key")
    socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = secret, public, server_public
