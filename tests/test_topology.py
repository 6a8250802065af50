from flyte_hvd.core.state import Topology


def test_two_hosts_two_ranks_each():
    hosts = ["a", "b", "a", "b"]
    topo = [Topology.from_hosts(hosts, r) for r in range(4)]
    assert [(t.local_rank, t.local_size) for t in topo] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [(t.cross_rank, t.cross_size) for t in topo] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert all(t.homogeneous for t in topo)


def test_uneven_hosts_are_not_homogeneous():
    hosts = ["a", "a", "a", "b"]
    topo = [Topology.from_hosts(hosts, r) for r in range(4)]
    assert [t.local_rank for t in topo] == [0, 1, 2, 0]
    assert topo[3].local_size == 1 and topo[0].local_size == 3
    assert [(t.cross_rank, t.cross_size) for t in topo] == [(0, 2), (0, 1), (0, 1), (1, 2)]
    assert not topo[0].homogeneous
