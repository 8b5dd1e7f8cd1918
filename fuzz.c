/*
 * fuzz.c — libFuzzer entry points for the readers that take bytes from
 * outside: the GGUF reader and the JSON parser (`make fuzz`). Each input is
 * fed to both; any crash, overrun or leak is a bug (ASan/UBSan report it).
 * Not part of the library or of `strata`.
 */
#include "strata.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    /* an exact-size copy, so reading one byte past the input is caught */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    struct gguf g;
    if (gguf_parse(&g, buf, size, err, sizeof err) == 0) {
        for (uint64_t i = 0; i < g.n_kv; i++)
            if (g.kv[i].type == GGUF_ARR && g.kv[i].arr_type == GGUF_STR && g.kv[i].n < 4096) {
                struct gguf_str *s = malloc((size_t)g.kv[i].n * sizeof *s + 1);
                if (s)
                    gguf_arr_strs(&g.kv[i], s);
                free(s);
            }
        gguf_close(&g);
    }
    struct json j;
    if (json_parse(&j, (const char *)buf, size, err, sizeof err) == 0)
        json_free(&j);
    free(buf);
    return 0;
}
