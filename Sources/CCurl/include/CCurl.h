// libcurl for Swift, loaded on first use.
//
// The daemon does not link libcurl: with its thirty-odd dependencies it was most of the time
// between exec and READY=1, and nothing before READY=1 needs it. tb_curl_load() dlopens
// libcurl.so.4 once (thread-safe) and resolves the functions below; every other tb_curl_*
// function may be called only after it returned 0.
//
// curl_easy_setopt, curl_easy_getinfo and curl_multi_setopt are variadic, which Swift cannot
// call, so each option kind gets a typed wrapper.
#ifndef TOKENBROKER_CCURL_H
#define TOKENBROKER_CCURL_H

#include <curl/curl.h>
#include <stddef.h>

/// Loads libcurl.so.4 and resolves every function (once; later calls return the first result).
/// 0 on success; else -1 with the reason (dlerror's) copied into `reason`.
int tb_curl_load(char *reason, size_t size);

CURLcode tb_curl_global_init(long flags);
const char *tb_curl_easy_strerror(CURLcode code);
void tb_curl_free(void *pointer);

CURL *tb_curl_easy_init(void);
void tb_curl_easy_cleanup(CURL *handle);
CURLcode tb_easy_setopt_long(CURL *handle, CURLoption option, long value);
CURLcode tb_easy_setopt_off(CURL *handle, CURLoption option, curl_off_t value);
CURLcode tb_easy_setopt_string(CURL *handle, CURLoption option, const char *value);
CURLcode tb_easy_setopt_pointer(CURL *handle, CURLoption option, void *value);
CURLcode tb_easy_setopt_slist(CURL *handle, CURLoption option, struct curl_slist *value);
CURLcode tb_easy_setopt_write_callback(CURL *handle, CURLoption option, curl_write_callback callback);
CURLcode tb_easy_setopt_sockopt_callback(CURL *handle, CURLoption option, curl_sockopt_callback callback);
CURLcode tb_easy_getinfo_long(CURL *handle, CURLINFO info, long *value);
CURLcode tb_easy_getinfo_off(CURL *handle, CURLINFO info, curl_off_t *value);

CURLM *tb_curl_multi_init(void);
CURLMcode tb_multi_setopt_long(CURLM *multi, CURLMoption option, long value);
CURLMcode tb_curl_multi_add_handle(CURLM *multi, CURL *handle);
CURLMcode tb_curl_multi_remove_handle(CURLM *multi, CURL *handle);
CURLMcode tb_curl_multi_perform(CURLM *multi, int *running);
CURLMsg *tb_curl_multi_info_read(CURLM *multi, int *left);
CURLMcode tb_curl_multi_poll(CURLM *multi, struct curl_waitfd *extra, unsigned int count, int timeout, int *ready);
CURLMcode tb_curl_multi_wakeup(CURLM *multi);

struct curl_slist *tb_curl_slist_append(struct curl_slist *list, const char *string);
void tb_curl_slist_free_all(struct curl_slist *list);

CURLU *tb_curl_url(void);
void tb_curl_url_cleanup(CURLU *handle);
CURLUcode tb_curl_url_set(CURLU *handle, CURLUPart part, const char *content, unsigned int flags);
CURLUcode tb_curl_url_get(CURLU *handle, CURLUPart part, char **content, unsigned int flags);

#endif
