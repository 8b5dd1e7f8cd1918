/* test_json.c — tests of json.c (filled in by its owner). */
#include "test.h"

void test_json(void)
{
}
