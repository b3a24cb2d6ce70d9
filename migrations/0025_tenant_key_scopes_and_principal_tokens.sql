-- Keys and principals a tenant can trust (issue 29, item 2; docs/security.md).
--
-- Before: every tenant key could do everything for its tenant and claim any principal in a
-- search; revoking one took SQL. Now each key has scopes, a search key may be bound to
-- fixed principals or be made to require a signed principal token, and keys are created,
-- listed, revoked and rotated by `kb tenants keys`.

-- What a key may do. `admin` includes `publish` and `search`. Keys that existed before this
-- migration keep working exactly as before: they become admin keys that take the
-- principals the caller names.
ALTER TABLE tenant_api_key
    ADD COLUMN name text CHECK (length(name) BETWEEN 1 AND 100),
    ADD COLUMN scopes text[] NOT NULL DEFAULT '{admin}'
        CHECK (cardinality(scopes) BETWEEN 1 AND 3
               AND scopes <@ ARRAY['publish', 'search', 'admin']::text[]),
    -- Where a search with this key takes its principals from: `caller` (the request's
    -- `principals`, or a principal token when one is sent), `fixed` (`principals` below,
    -- whatever the request says) or `token` (only a verified principal token).
    ADD COLUMN principal_source text NOT NULL DEFAULT 'caller'
        CHECK (principal_source IN ('caller', 'fixed', 'token')),
    ADD COLUMN principals text[]
        CHECK (principals IS NULL OR cardinality(principals) BETWEEN 1 AND 1000),
    -- The key that replaced this one (`kb tenants keys rotate`).
    ADD COLUMN replaced_by uuid REFERENCES tenant_api_key (key_id),
    ADD CONSTRAINT tenant_api_key_fixed_principals
        CHECK ((principal_source = 'fixed') = (principals IS NOT NULL)),
    -- A key that decides principals is a search key and nothing else: an admin or publish
    -- key bound to principals would be a contradiction nobody could read off its list line.
    ADD CONSTRAINT tenant_api_key_bound_keys_only_search
        CHECK (principal_source = 'caller' OR scopes = ARRAY['search']::text[]);
-- (The default stays for keys inserted by older code during a rolling upgrade: they get
-- what every key had before. `kb` itself always names the scopes.)

-- revoked_at is now the moment a key stops working: `revoke` sets it to now, `rotate
-- --grace-seconds N` to N seconds ahead (the old key works until then). The key check
-- compares it with the time of the request.

-- The keys a tenant's principal tokens are verified with: an Ed25519 or RSA public key
-- (PEM) or an HMAC secret, each with the one JWT algorithm it accepts. A token names its
-- key by `kid`; only the keys of the tenant whose API key came with the token are looked
-- at, so a token signed for another tenant finds no key.
CREATE TABLE tenant_verification_key (
    tenant_id    text        NOT NULL REFERENCES tenant (tenant_id),
    kid          text        NOT NULL CHECK (kid ~ '^[A-Za-z0-9._:-]{1,64}$'),
    algorithm    text        NOT NULL CHECK (algorithm IN ('EdDSA', 'RS256', 'RS384', 'RS512',
                                                           'PS256', 'PS384', 'PS512', 'HS256',
                                                           'HS384', 'HS512')),
    -- PEM of the public key (EdDSA, RS*, PS*), or the HMAC secret (HS*). An HMAC secret
    -- signs as well as verifies: whoever reads this table could mint tokens, which is why
    -- the public-key kinds are the ones to prefer.
    key_material text        NOT NULL CHECK (length(key_material) BETWEEN 32 AND 16384),
    -- The `aud` a token must carry (NULL: `kb:<tenant>`) and, when set, its `iss`.
    audience     text        CHECK (length(audience) BETWEEN 1 AND 200),
    issuer       text        CHECK (length(issuer) BETWEEN 1 AND 200),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, kid)
);
