/* test_cli.c — tests of cli.c (filled in by its owner). */
#include "test.h"

void test_cli(void)
{
}
