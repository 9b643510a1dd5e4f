"""The messages between a requester and the rank server (:mod:`megapatch.testing.ranks.rank_server`)
on its Unix socket: a request is an 8-byte length, sent with the requester's file descriptors,
then the pickled request; the server answers with 8-byte words (the child's pid, then its wait
status)."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any, Dict, Optional, Sequence

_QWORD = struct.Struct("!q")


def _recv_exactly(sock: socket.socket, size: int) -> Optional[bytes]:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _recv_qword(sock: socket.socket) -> Optional[int]:
    data = _recv_exactly(sock, _QWORD.size)
    return None if data is None else _QWORD.unpack(data)[0]


def _send_request(sock: socket.socket, request: Dict[str, Any], fds: Sequence[int]) -> None:
    payload = pickle.dumps(request)
    socket.send_fds(sock, [_QWORD.pack(len(payload))], list(fds))
    sock.sendall(payload)


def _recv_request(sock: socket.socket):
    header, fds, _flags, _addr = socket.recv_fds(sock, _QWORD.size, 3)
    rest = _recv_exactly(sock, _QWORD.size - len(header)) if len(header) < _QWORD.size else b""
    if not header or rest is None:
        return None, fds
    payload = _recv_exactly(sock, _QWORD.unpack(header + rest)[0])
    return (None if payload is None else pickle.loads(payload)), fds
