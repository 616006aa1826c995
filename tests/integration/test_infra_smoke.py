"""The test infrastructure itself: every backing service answers with the test's settings."""

import boto3
import pika
import redis

from fedhive.config import Settings


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
