"""The test infrastructure itself: every backing service answers with the test's settings."""

import subprocess

import boto3
import pika
import redis

from fedhive.config import Settings
from tests.fixtures.rabbitmqctl import CTL


def test_services_answer(settings: Settings) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    assert connection.is_open
    connection.close()
    client = redis.Redis.from_url(settings.redis_url)
    assert client.ping()
    client.close()
    s3 = boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        aws_access_key_id=settings.aws_access_key_id,
        aws_secret_access_key=settings.aws_secret_access_key,
        region_name=settings.s3_region,
    )
    assert "Buckets" in s3.list_buckets()


def test_the_tests_rabbitmqctl_evaluates_as_rabbitmqctl_does() -> None:
    """`tests.fixtures.rabbitmqctl.CTL` (eval through erl_call) prints what `rabbitmqctl eval`
    prints, takes the expression from stdin too, and fails on an error as it does."""
    expression = 'io:format("queue ~s~n", [<<"q">>]), lists:seq(1, 3).'
    for ctl in (CTL, ("rabbitmqctl",)):
        done = subprocess.run([*ctl, "eval", expression], capture_output=True, text=True,
                              timeout=60, check=True)
        assert done.stdout == "queue q\n[1,2,3]\n", ctl
        piped = subprocess.run([*ctl, "eval"], input="node() =/= nonode@nohost.",
                               capture_output=True, text=True, timeout=60, check=True)
        assert piped.stdout == "true\n", ctl
        failed = subprocess.run([*ctl, "eval", "error(boom)."], capture_output=True, text=True,
                                timeout=60, check=False)
        assert failed.returncode != 0 and "boom" in failed.stdout + failed.stderr, ctl
