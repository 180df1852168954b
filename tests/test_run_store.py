"""Where the job's rendezvous store listens (``run/pool.py``; issue 30)."""

from __future__ import annotations


def test_the_rendezvous_store_listens_on_the_given_address_only():
    """Issue 30: ``TCPStore(host, 0, is_master=True)`` listened on every interface; the pool's store
    is bound to the loopback for a local run (the driver's node address on several nodes)."""
    import torch.distributed as dist

    from nereus.runtime.run.pool import host_store

    store, sock = host_store("127.0.0.1")
    assert sock.getsockname()[0] == "127.0.0.1" and store.port == sock.getsockname()[1]
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    sock.close()
