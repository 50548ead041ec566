"""``python -m ernie_moe.doctor [--layouts]``: will this machine compute what the tests here proved?"""
