"""Where dblock meets applications: :mod:`dblock.contrib.flask` and
:mod:`dblock.contrib.django`.

They sit on top of :class:`~dblock.LockManager` and import nothing the core
depends on; Flask and Django are optional (``pip install '.[flask]'``,
``'.[django]'`` in dblock's clone).
"""
