"""Settings of the dblock example project (PostgreSQL; see the README).

The database comes from the environment: EXAMPLE_DB_NAME (default
``dblock_example``), EXAMPLE_DB_HOST, EXAMPLE_DB_PORT, EXAMPLE_DB_USER,
EXAMPLE_DB_PASSWORD.
"""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "exampleproject.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "dblock.contrib.django",  # the lock table, commands, admin page
    "accounts",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "dblock.contrib.django.middleware.LockBusyMiddleware",  # LockBusy -> 409
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("EXAMPLE_DB_NAME", "dblock_example"),
        "HOST": os.environ.get("EXAMPLE_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("EXAMPLE_DB_PORT", "5432"),
        "USER": os.environ.get("EXAMPLE_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("EXAMPLE_DB_PASSWORD", ""),
    }
}

# dblock: every key is optional. The locks live in DATABASES["default"] on
# dblock's own connections (never inside a request's transaction).
DBLOCK = {
    "TTL": 30,  # seconds a crashed worker can block a user
}
STATIC_URL = "static/"
