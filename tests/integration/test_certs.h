// Test certificates made with OpenSSL's X509 API: CAs, server and client certificates,
// with any validity window (an expired one included), written as PEM.
#pragma once

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>

namespace kvferry::testing {

struct KeyAndCert {
  std::shared_ptr<EVP_PKEY> key;
  std::shared_ptr<X509> cert;

  std::string KeyPem() const {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
    PEM_write_bio_PrivateKey(bio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr);
    return Drain(bio.get());
  }
  std::string CertPem() const {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
    PEM_write_bio_X509(bio.get(), cert.get());
    return Drain(bio.get());
  }

 private:
  static std::string Drain(BIO* bio) {
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio, &data);
    return std::string(data, static_cast<size_t>(n));
  }
};

struct CertSpec {
  std::string common_name;
  bool is_ca = false;
  std::string subject_alt_names;       // e.g. "DNS:localhost,IP:127.0.0.1"; empty: none
  long not_before_seconds = -3600;     // relative to now
  long not_after_seconds = 24 * 3600;  // relative to now
};

// A P-256 key and a certificate signed by `issuer` (self-signed when null).
inline KeyAndCert MakeCert(const CertSpec& spec, const KeyAndCert* issuer = nullptr) {
  static long serial = 1;
  KeyAndCert out;
  out.key.reset(EVP_EC_gen("P-256"), &EVP_PKEY_free);
  out.cert.reset(X509_new(), &X509_free);
  X509* x = out.cert.get();
  if (out.key == nullptr || x == nullptr) throw std::runtime_error("openssl: key or cert");
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), serial++);
  X509_gmtime_adj(X509_getm_notBefore(x), spec.not_before_seconds);
  X509_gmtime_adj(X509_getm_notAfter(x), spec.not_after_seconds);
  X509_set_pubkey(x, out.key.get());
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(spec.common_name.c_str()), -1,
                             -1, 0);
  X509* issuer_cert = issuer != nullptr ? issuer->cert.get() : x;
  X509_set_issuer_name(x, X509_get_subject_name(issuer_cert));
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer_cert, x, nullptr, nullptr, 0);
  auto add = [&](int nid, const std::string& value) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
    if (ext == nullptr) throw std::runtime_error("openssl: extension " + value);
    X509_add_ext(x, ext, -1);
    X509_EXTENSION_free(ext);
  };
  add(NID_basic_constraints, spec.is_ca ? "critical,CA:TRUE" : "critical,CA:FALSE");
  add(NID_key_usage, spec.is_ca ? "critical,keyCertSign,cRLSign" : "critical,digitalSignature");
  if (!spec.is_ca) add(NID_ext_key_usage, "serverAuth,clientAuth");
  if (!spec.subject_alt_names.empty()) add(NID_subject_alt_name, spec.subject_alt_names);
  EVP_PKEY* signer = issuer != nullptr ? issuer->key.get() : out.key.get();
  if (X509_sign(x, signer, EVP_sha256()) == 0) throw std::runtime_error("openssl: sign");
  return out;
}

inline void WriteFile(const std::string& path, const std::string& text) {
  // Written beside and renamed: a watcher never reads half a file.
  const std::string temp = path + ".tmp";
  std::ofstream(temp, std::ios::binary | std::ios::trunc) << text;
  std::rename(temp.c_str(), path.c_str());
}

}  // namespace kvferry::testing
