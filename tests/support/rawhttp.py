"""Reading raw HTTP/1.x responses in tests that talk to the proxy over a bare socket."""

from __future__ import annotations

from multidict import CIMultiDict


def parse_raw(reply: bytes) -> tuple[str, CIMultiDict[str], bytes]:
    """Status line, headers and de-chunked body of a raw HTTP/1.x response."""
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while body:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out += body[:size]
            body = body[size + 2 :]
        body = bytes(out)
    return status_line, headers, body
