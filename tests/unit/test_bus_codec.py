"""Pure parts of the bus: the type registry, error translation, parameters and queue specs."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from fedhive.bus.codec import (
    ATTACHED_HEADER,
    HEAD_HEADER,
    HEAD_MAX,
    Encoded,
    Parts,
    TypeRegistry,
    encode,
    error_from_message,
    error_message,
    joined,
    split,
    type_name,
)
from fedhive.bus.connection import connection_parameters, user_name
from fedhive.bus.publisher import properties
from fedhive.bus.topology import Topology
from fedhive.errors import ConfigError, FedhiveError, MalformedMessage, NotFound, RpcTimeout
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, site_pb2
from tests.fixtures.certs import CertAuthority


def test_registry_decodes_the_types_it_accepts() -> None:
    registry = TypeRegistry([site_pb2.DeployRequest, site_pb2.AbortRequest])
    body = site_pb2.DeployRequest(job_id="j", app_name="app").SerializeToString()
    decoded = registry.decode("fedhive.v1.DeployRequest", body, queue="q")
    assert decoded == site_pb2.DeployRequest(job_id="j", app_name="app")
    assert type_name(decoded) == "fedhive.v1.DeployRequest"
    assert registry.names() == ["fedhive.v1.AbortRequest", "fedhive.v1.DeployRequest"]


@pytest.mark.parametrize(
    ("name", "body", "reason"),
    [
        (None, b"", "has no type property"),
        ("", b"", "has no type property"),
        ("fedhive.v1.StartRequest", b"", "'fedhive.v1.StartRequest' is not accepted on q"),
        ("fedhive.v1.DeployRequest", b"\xff\xff\xff", "does not parse"),
    ],
)
def test_registry_rejects_malformed_messages_with_a_reason(
    name: str | None, body: bytes, reason: str
) -> None:
    with pytest.raises(MalformedMessage, match=reason) as caught:
        TypeRegistry([site_pb2.DeployRequest]).decode(name, body, queue="q")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [NotFound("job 'x' does not exist", field="job_id"), RpcTimeout("late"), FedhiveError("x")],
)
def test_errors_round_trip_through_the_error_message(error: FedhiveError) -> None:
    wire = common_pb2.Error.FromString(error_message(error).SerializeToString())
    back = error_from_message(wire)
    assert type(back) is type(error)
    assert (back.message, back.field) == (error.message, error.field)


def test_unknown_error_code_becomes_the_root_error() -> None:
    back = error_from_message(common_pb2.Error(code="FROM_THE_FUTURE", message="m"))
    assert type(back) is FedhiveError and back.field is None


def test_amqps_url_verifies_the_server_by_its_host_name() -> None:
    params = connection_parameters("amqps://u:p@b-1.mq.example.com:5671/%2F", name="t.pub")
    assert params.ssl_options is not None
    assert params.ssl_options.server_hostname == "b-1.mq.example.com"
    context = params.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert params.client_properties == {"connection_name": "t.pub"}
    assert user_name(params) == "u"


def test_amqps_url_with_a_ca_file_trusts_that_ca_alone(tmp_path: Path) -> None:
    ca = CertAuthority.create(tmp_path / "ca", name="fedhive unit CA")
    params = connection_parameters("amqps://u:p@localhost:5671/%2F", name="t", ca_file=str(ca.pem))
    assert params.ssl_options is not None
    context = params.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    subjects = [dict(part[0] for part in cert["subject"]) for cert in context.get_ca_certs()]
    assert subjects == [{"commonName": "fedhive unit CA"}]


@pytest.mark.parametrize(("content", "reason"), [
    (None, "No such file or directory"),
    ("not a certificate\n", "not a PEM CA certificate"),
])
def test_a_bad_ca_file_is_one_line_naming_the_file(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    ca_file = tmp_path / "ca.pem"
    if content is not None:
        ca_file.write_text(content)
    with pytest.raises(ConfigError, match=reason) as caught:
        connection_parameters("amqps://u:p@localhost:5671/%2F", name="t", ca_file=str(ca_file))
    assert str(ca_file) in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.field == "amqp_ca_file"


@pytest.mark.parametrize("url", [
    "amqps://u:p@localhost:5671/%2F?ssl_options=%7B%27cert_reqs%27%3A0%7D",
    "amqp://u:p@localhost:5672/%2F?heartbeat=5&ssl_options=%7B%7D",
])
def test_ssl_options_in_the_url_are_refused(url: str) -> None:
    """One way to set TLS (the CA file): no URL can turn certificate checks off."""
    with pytest.raises(ConfigError, match=r"\?ssl_options=.*FEDHIVE_AMQP_CA_FILE") as caught:
        connection_parameters(url, name="t")
    assert caught.value.field == "amqp_url"


def test_amqp_url_has_no_tls() -> None:
    params = connection_parameters("amqp://guest:guest@127.0.0.1:5672/%2F", name="t", heartbeat=7)
    assert params.ssl_options is None and params.heartbeat == 7


def test_queue_specs_bind_by_name_and_patterns() -> None:
    topology = Topology(Names("ns"), delivery_limit=2)
    spec = topology.command_queue("ns.site.a", ["ns.site.*"])
    assert (spec.exchange, spec.binding_keys) == ("ns.cmd", ("ns.site.a", "ns.site.*"))
    events = topology.events_queue("scheduler", ["job.status.*"])
    assert (events.name, events.exchange) == ("ns.events.scheduler", "ns.events")
    with pytest.raises(ValueError, match="at least one pattern"):
        topology.events_queue("x", [])
    with pytest.raises(ValueError, match="delivery_limit"):
        Topology(Names("ns"), delivery_limit=0)
    assert spec.queue_type == "quorum"
    assert topology.command_queue("ns.job.j.server", queue_type="classic").queue_type == "classic"
    with pytest.raises(ValueError, match="queue_type"):
        topology.command_queue("ns.x", queue_type="stream")


def test_commands_are_persistent_and_rpc_requests_may_be_transient() -> None:
    assert properties(site_pb2.AbortRequest).delivery_mode == 2
    assert properties(site_pb2.AbortRequest, persistent=False).delivery_mode == 1


def test_an_encoded_reply_is_its_shared_body_with_its_own_head_merged_over_it() -> None:
    """What a caller of a broadcast's task gets: the body shared by every caller, sent as it is,
    and its own part in a header; the head wins where both set a field."""
    body = site_pb2.CheckResourcesReply(ok=True, token="shared").SerializeToString()
    head = site_pb2.CheckResourcesReply(token="own").SerializeToString()
    reply = Encoded(site_pb2.CheckResourcesReply, body, head)
    sent, kind, headers = encode(reply)
    assert sent is body and kind is site_pb2.CheckResourcesReply and headers == {HEAD_HEADER: head}
    assert reply.decode() == site_pb2.CheckResourcesReply(ok=True, token="own")
    assert encode(Encoded(site_pb2.CheckResourcesReply, body))[2] == {}  # no head, no header


def test_a_large_head_is_joined_to_the_body_instead() -> None:
    """A message's headers travel in one AMQP frame: a head past HEAD_MAX (a task with large
    props) goes in the body, which parses to the same message."""
    body = site_pb2.CheckResourcesReply(ok=True).SerializeToString()
    head = site_pb2.CheckResourcesReply(token="t" * (HEAD_MAX + 1)).SerializeToString()
    sent, _, headers = encode(Encoded(site_pb2.CheckResourcesReply, body, head))
    assert headers == {} and sent == body + head
    assert site_pb2.CheckResourcesReply.FromString(sent).token == "t" * (HEAD_MAX + 1)


def test_a_head_that_does_not_parse_is_malformed_naming_the_header() -> None:
    bad = Encoded(site_pb2.CheckResourcesReply, b"", b"\xff\xff")
    with pytest.raises(MalformedMessage, match=HEAD_HEADER) as caught:
        bad.decode()
    assert caught.value.field == HEAD_HEADER


def test_an_attachment_follows_the_body_and_is_split_off_again() -> None:
    """A message's attachment (a result's or a task's inline arrays) is sent after its
    encoding; the receiver gets the encoding and a view of the attachment (no copy of it)."""
    body = site_pb2.CheckResourcesRequest(job_id="j1").SerializeToString()
    message = Encoded.attaching(site_pb2.CheckResourcesRequest, body,
                                [b"abc", memoryview(b"defg")])
    parts, _, headers = encode(message)
    assert isinstance(parts, Parts) and len(parts) == len(body) + 7  # never joined to send
    sent = joined(parts)
    assert sent == body + b"abcdefg" and headers == {ATTACHED_HEADER: 7}
    proto, attachment = split(sent, headers, queue="q")
    assert proto == body and bytes(attachment) == b"abcdefg"
    assert attachment.obj is sent  # a view of the body as it arrived
    assert message.decode() == site_pb2.CheckResourcesRequest(job_id="j1")
    assert split(body, {}, queue="q") == (body, memoryview(b""))
    assert Encoded.attaching(site_pb2.CheckResourcesRequest, body, []).attached == 0


def test_a_large_head_goes_between_the_body_and_its_attachment() -> None:
    body = site_pb2.CheckResourcesReply(ok=True).SerializeToString()
    head = site_pb2.CheckResourcesReply(token="t" * (HEAD_MAX + 1)).SerializeToString()
    sent, _, headers = encode(Encoded.attaching(site_pb2.CheckResourcesReply, body, [b"xyz"],
                                                head))
    sent = joined(sent)
    assert headers == {ATTACHED_HEADER: 3} and sent == body + head + b"xyz"
    proto, attachment = split(sent, headers, queue="q")
    assert site_pb2.CheckResourcesReply.FromString(proto).token == "t" * (HEAD_MAX + 1)
    assert attachment == b"xyz"


@pytest.mark.parametrize("size", [-1, 100, "7"])
def test_an_attachment_length_outside_the_body_is_malformed(size: object) -> None:
    with pytest.raises(MalformedMessage, match=f"{ATTACHED_HEADER} .* on q") as caught:
        split(b"0123456789", {ATTACHED_HEADER: size}, queue="q")
    assert caught.value.field == ATTACHED_HEADER
