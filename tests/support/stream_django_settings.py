"""The example project's settings with the streaming views of stream_django_urls."""

from exampleproject.settings import *  # noqa: F403

ROOT_URLCONF = "tests.support.stream_django_urls"
