"""CurveZMQ on the role-to-role sockets (issue 38): encrypted, authenticated links, and only the
roster's members admitted.

Each role makes a key pair when it starts (:meth:`CurveKeys.generate`; the secret key never
leaves the process) and announces its public key in its roster entry (``curve_key``, with
``curve``: whether its ROUTER requires CurveZMQ). The controller hands the roster, keys
included, to every role through Ray's authenticated session; nothing about keys travels in a
specmesh wire message.

- A ROUTER with Curve on is a CURVE server (``curve_server``, its secret key) with a ZAP
  handler (:class:`RosterAuthenticator`, pyzmq's ThreadAuthenticator with a credentials
  callback) that admits a client only when its public key is in the newest roster: a peer
  with any other key is refused during the handshake, before any message of it reaches the
  role (a plain-TCP peer cannot even start one), counted (``num_refused``) and logged with
  its address.
- A DEALER that dials a peer whose entry says ``curve`` is a CURVE client with its own key
  pair and the peer's public key as the server key (so it also knows it talks to the roster's
  peer, not an impostor on its address).

The ZAP handler binds per ZMQ context, so a mailbox with Curve on owns its context.
Curve costs at connect (the handshake) and per byte (encryption), never a message of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

#: the ZAP domain of the role sockets
ZAP_DOMAIN = "specmesh"
#: refusals are logged at most this often, seconds (the rest are counted)
LOG_EVERY_S = 1.0
#: transport modes (``ClusterConfig.transport``): ``auto`` is resolved where a role runs
AUTO, CURVE, INSECURE = "auto", "curve", "insecure"


@dataclass(frozen=True)
class CurveKeys:
    """A CurveZMQ key pair, Z85-encoded (40 ASCII bytes each). ``secret`` stays out of the
    repr."""

    public: bytes
    secret: bytes = field(repr=False)

    @staticmethod
    def available() -> bool:
        """Whether this libzmq has CURVE (pyzmq's wheels do)."""
        return bool(zmq.has("curve"))

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair (libzmq's ``zmq_curve_keypair``).

        Raises:
            RuntimeError: this libzmq was built without CURVE.
        """
        if not cls.available():
            raise RuntimeError("this libzmq has no CURVE support (pyzmq wheels have it): "
                               "run the roles with --insecure-transport or install pyzmq "
                               "from its wheels")
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address a role binds) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def curve_enabled(mode: str, bind_host: str) -> bool:
    """Whether a role bound on ``bind_host`` requires CurveZMQ on its ROUTER: ``curve``
    always, ``insecure`` never, ``auto`` unless the address is a loopback one (another host
    cannot reach it; the embedded single-machine cluster of ``specmesh serve``).

    Raises:
        ValueError: an unknown mode.
    """
    if mode == CURVE:
        return True
    if mode == INSECURE:
        return False
    if mode == AUTO:
        return not is_loopback(bind_host)
    raise ValueError(f"unknown transport mode {mode!r} (auto, curve, insecure)")


def roster_keys(roster: list[dict]) -> frozenset[bytes]:
    """The public keys (Z85 bytes) the roster's entries announce."""
    return frozenset(r["curve_key"].encode() for r in roster if r.get("curve_key"))


class RosterAuthenticator(ThreadAuthenticator):
    """ZAP handler of one mailbox's context: CURVE clients whose public key is in
    :attr:`allowed` pass; any other is refused, counted in :attr:`num_refused` and logged with
    its address. ``name``: the mailbox's, for the log."""

    def __init__(self, context: zmq.Context, name: str) -> None:
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self.name = name
        #: Z85 public keys admitted; replaced whole (one reference swap) from other threads
        self.allowed: frozenset[bytes] = frozenset()
        self.num_refused = 0
        self._address = "?"
        self._logged_at = -LOG_EVERY_S  # monotonic time of the last refusal logged
        self._unlogged = 0  # refusals since then, not logged (a flood is logged once a second)

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(ZAP_DOMAIN, self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # the address is in the ZAP request only; the key check (callback) reads it here
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: admit ``key`` (Z85) when the roster has it."""
        if key in self.allowed:
            return True
        self.num_refused += 1
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return False
        more = f" ({self._unlogged} more refused since the last one logged)" \
            if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        log.warning("%s: refused a CurveZMQ peer at %s: its public key %s is not in the "
                    "roster%s", self.name, self._address, key.decode(errors="replace"), more)
        return False


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server with ``keys`` under the ZAP domain."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket, keys: CurveKeys, server_key: bytes) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the server whose public key is
    ``server_key`` (Z85)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key
