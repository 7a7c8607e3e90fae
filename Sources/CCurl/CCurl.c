// See include/CCurl.h: libcurl.so.4, opened on first use.
#define _GNU_SOURCE
#include "CCurl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

// Every function used, once: X(name, return type, parameter list). The variadic ones are
// declared with their fixed parameters and `...`.
#define TB_CURL_FUNCTIONS(X) \
    X(curl_version_info, curl_version_info_data *, (CURLversion)) \
    X(curl_global_init, CURLcode, (long)) \
    X(curl_easy_strerror, const char *, (CURLcode)) \
    X(curl_free, void, (void *)) \
    X(curl_easy_init, CURL *, (void)) \
    X(curl_easy_cleanup, void, (CURL *)) \
    X(curl_easy_setopt, CURLcode, (CURL *, CURLoption, ...)) \
    X(curl_easy_getinfo, CURLcode, (CURL *, CURLINFO, ...)) \
    X(curl_multi_init, CURLM *, (void)) \
    X(curl_multi_setopt, CURLMcode, (CURLM *, CURLMoption, ...)) \
    X(curl_multi_add_handle, CURLMcode, (CURLM *, CURL *)) \
    X(curl_multi_remove_handle, CURLMcode, (CURLM *, CURL *)) \
    X(curl_multi_perform, CURLMcode, (CURLM *, int *)) \
    X(curl_multi_info_read, CURLMsg *, (CURLM *, int *)) \
    X(curl_multi_poll, CURLMcode, (CURLM *, struct curl_waitfd *, unsigned int, int, int *)) \
    X(curl_multi_wakeup, CURLMcode, (CURLM *)) \
    X(curl_slist_append, struct curl_slist *, (struct curl_slist *, const char *)) \
    X(curl_slist_free_all, void, (struct curl_slist *)) \
    X(curl_url, CURLU *, (void)) \
    X(curl_url_cleanup, void, (CURLU *)) \
    X(curl_url_set, CURLUcode, (CURLU *, CURLUPart, const char *, unsigned int)) \
    X(curl_url_get, CURLUcode, (CURLU *, CURLUPart, char **, unsigned int))

#define TB_POINTER(name, result, parameters) static result (*p_##name) parameters;
TB_CURL_FUNCTIONS(TB_POINTER)

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int loaded = -1;
static char failure[256];

static void load(void) {
    void *library = dlopen("libcurl.so.4", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        const char *why = dlerror();
        snprintf(failure, sizeof failure, "%s", why ? why : "dlopen(libcurl.so.4) failed");
        return;
    }
#define TB_RESOLVE(name, result, parameters) \
    *(void **)&p_##name = dlsym(library, #name); \
    if (p_##name == NULL) { snprintf(failure, sizeof failure, "libcurl.so.4 has no %s (libcurl 7.85 or later is needed)", #name); return; }
    TB_CURL_FUNCTIONS(TB_RESOLVE)
    // CURLOPT_PROTOCOLS_STR, which every request sets, came in 7.85.0.
    const curl_version_info_data *version = p_curl_version_info(CURLVERSION_NOW);
    if (version == NULL || version->version_num < 0x075500) {
        snprintf(failure, sizeof failure, "libcurl %s is too old (7.85 or later is needed)", version && version->version ? version->version : "?");
        return;
    }
    loaded = 0;
}

int tb_curl_load(char *reason, size_t size) {
    pthread_once(&once, load);
    if (loaded != 0 && reason != NULL && size > 0) snprintf(reason, size, "%s", failure);
    return loaded;
}

CURLcode tb_curl_global_init(long flags) { return p_curl_global_init(flags); }
const char *tb_curl_easy_strerror(CURLcode code) { return p_curl_easy_strerror(code); }
void tb_curl_free(void *pointer) { p_curl_free(pointer); }

CURL *tb_curl_easy_init(void) { return p_curl_easy_init(); }
void tb_curl_easy_cleanup(CURL *handle) { p_curl_easy_cleanup(handle); }
CURLcode tb_easy_setopt_long(CURL *handle, CURLoption option, long value) { return p_curl_easy_setopt(handle, option, value); }
CURLcode tb_easy_setopt_off(CURL *handle, CURLoption option, curl_off_t value) { return p_curl_easy_setopt(handle, option, value); }
CURLcode tb_easy_setopt_string(CURL *handle, CURLoption option, const char *value) { return p_curl_easy_setopt(handle, option, value); }
CURLcode tb_easy_setopt_pointer(CURL *handle, CURLoption option, void *value) { return p_curl_easy_setopt(handle, option, value); }
CURLcode tb_easy_setopt_slist(CURL *handle, CURLoption option, struct curl_slist *value) { return p_curl_easy_setopt(handle, option, value); }
CURLcode tb_easy_setopt_write_callback(CURL *handle, CURLoption option, curl_write_callback callback) { return p_curl_easy_setopt(handle, option, callback); }
CURLcode tb_easy_setopt_sockopt_callback(CURL *handle, CURLoption option, curl_sockopt_callback callback) { return p_curl_easy_setopt(handle, option, callback); }
CURLcode tb_easy_getinfo_long(CURL *handle, CURLINFO info, long *value) { return p_curl_easy_getinfo(handle, info, value); }
CURLcode tb_easy_getinfo_off(CURL *handle, CURLINFO info, curl_off_t *value) { return p_curl_easy_getinfo(handle, info, value); }

CURLM *tb_curl_multi_init(void) { return p_curl_multi_init(); }
CURLMcode tb_multi_setopt_long(CURLM *multi, CURLMoption option, long value) { return p_curl_multi_setopt(multi, option, value); }
CURLMcode tb_curl_multi_add_handle(CURLM *multi, CURL *handle) { return p_curl_multi_add_handle(multi, handle); }
CURLMcode tb_curl_multi_remove_handle(CURLM *multi, CURL *handle) { return p_curl_multi_remove_handle(multi, handle); }
CURLMcode tb_curl_multi_perform(CURLM *multi, int *running) { return p_curl_multi_perform(multi, running); }
CURLMsg *tb_curl_multi_info_read(CURLM *multi, int *left) { return p_curl_multi_info_read(multi, left); }
CURLMcode tb_curl_multi_poll(CURLM *multi, struct curl_waitfd *extra, unsigned int count, int timeout, int *ready) { return p_curl_multi_poll(multi, extra, count, timeout, ready); }
CURLMcode tb_curl_multi_wakeup(CURLM *multi) { return p_curl_multi_wakeup(multi); }

struct curl_slist *tb_curl_slist_append(struct curl_slist *list, const char *string) { return p_curl_slist_append(list, string); }
void tb_curl_slist_free_all(struct curl_slist *list) { p_curl_slist_free_all(list); }

CURLU *tb_curl_url(void) { return p_curl_url(); }
void tb_curl_url_cleanup(CURLU *handle) { p_curl_url_cleanup(handle); }
CURLUcode tb_curl_url_set(CURLU *handle, CURLUPart part, const char *content, unsigned int flags) { return p_curl_url_set(handle, part, content, flags); }
CURLUcode tb_curl_url_get(CURLU *handle, CURLUPart part, char **content, unsigned int flags) { return p_curl_url_get(handle, part, content, flags); }
