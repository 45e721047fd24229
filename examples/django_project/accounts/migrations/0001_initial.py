from django.db import migrations, models


def create_accounts(apps, schema_editor):
    Account = apps.get_model("accounts", "Account")
    Account.objects.bulk_create([Account(id=1, balance=1000), Account(id=2, balance=1000)])


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Account",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("balance", models.IntegerField()),
            ],
        ),
        migrations.RunPython(create_accounts, migrations.RunPython.noop),
    ]
