"""Settings of the dblock example project (PostgreSQL by default). How to run it:
docs/django.md; what ``DBLOCK`` takes: the Settings section of docs/django.md.

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

# EXAMPLE_DB_ENGINE: postgresql (default), mysql (MariaDB through PyMySQL) or
# sqlite (EXAMPLE_DB_NAME is then the file, default db.sqlite3).
ENGINE = os.environ.get("EXAMPLE_DB_ENGINE", "postgresql")
if ENGINE == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("EXAMPLE_DB_NAME", "db.sqlite3"),
        }
    }
else:
    if ENGINE == "mysql":
        import pymysql

        pymysql.install_as_MySQLdb()
    DATABASES = {
        "default": {
            "ENGINE": f"django.db.backends.{ENGINE}",
            "NAME": os.environ.get("EXAMPLE_DB_NAME", "dblock_example"),
            "HOST": os.environ.get("EXAMPLE_DB_HOST", "127.0.0.1"),
            "PORT": os.environ.get("EXAMPLE_DB_PORT", "3306" if ENGINE == "mysql" else "5432"),
            "USER": os.environ.get("EXAMPLE_DB_USER", "root" if ENGINE == "mysql" else "postgres"),
            "PASSWORD": os.environ.get("EXAMPLE_DB_PASSWORD", ""),
        }
    }
# Every view runs in one transaction. dblock's locks taken inside it are held
# until it commits, so the next request for the user reads the new balance.
DATABASES["default"]["ATOMIC_REQUESTS"] = os.environ.get("EXAMPLE_ATOMIC_REQUESTS", "1") == "1"

# dblock: every key is optional. The locks live in DATABASES["default"] on
# dblock's own connections (never inside a request's transaction).
DBLOCK = {
    "TTL": 30,  # seconds a crashed worker can block a user
}
STATIC_URL = "static/"
